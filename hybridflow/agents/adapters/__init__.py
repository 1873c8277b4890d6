"""Other ecosystems' agents and environments, unchanged, behind ours: Gymnasium-style environments
(`gym_runner`), verifiers environments (`verifiers_runner`) and OpenEnv servers (`openenv_runner`) played
through the endpoint; verl's tools (`verl_tools`) and interactions (`verl_interaction`) as tools and
environments of the in-process loop."""
