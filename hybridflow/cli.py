"""The `hybridflow` command line: one entry point, one subcommand per job.

    hybridflow train --config recipes/grpo.yaml model.path=MODEL data.train_files=train.parquet
    hybridflow export outputs/run/checkpoints/step_00000010 outputs/run/hf
    hybridflow config [--command sft|dpo|rm] [--config FILE] [key=value ...]  # check it as the command would
    hybridflow report outputs/run [--out FILE.html]        # plots + HTML page of a run
    hybridflow sft --config recipes/sft.yaml model.path=MODEL data.train_files=chats.jsonl
    hybridflow dpo --config recipes/preference/dpo.yaml model.path=MODEL data.train_files=pairs.jsonl
    hybridflow rm --config recipes/preference/reward_model.yaml model.path=MODEL data.train_files=pairs.jsonl
    hybridflow demo [--output-dir outputs/demo]            # SFT then GRPO on a tiny model, offline
    hybridflow migrate run_verl.sh|verl.yaml [--out R.yaml]  # a recipe from a verl command line or config

Exit status of `train`, `sft`, `dpo` and `rm`: 0 the run finished; 2 it was refused or stopped on something
to fix first (config, data, output directory, checkpoint, disk space for checkpoints or logs, a reward function
or an environment that fails every row), printed as one line `hybridflow <command>: ...`; 75
(`PREEMPTED_EXIT_CODE`) stopped by SIGINT / SIGTERM after saving a checkpoint (run the same command again
to resume); 128 + the signal's number (130 SIGINT, 143 SIGTERM) stopped at once by a signal outside a
training step (while starting) or by a second one during a step; 1 any other error (a traceback).
docs/troubleshooting.md lists them.

`config` makes every check its command (`--command`, default train) makes before any model loads, without
writing anything: the config's, the output directory's (writable, room for a checkpoint, no live run holding
it), the checkpoint to resume from, every data row and what the reward functions need of the data
(`hybridflow.trainer.preflight`). It prints the resolved config and exits 0, or lists every problem at once
(`hybridflow config: ...`) and exits 2; `--no-checks` checks only keys, types and choices.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hybridflow.utils.stop_signals import Interrupted


def _train(args: argparse.Namespace) -> int:
    from hybridflow.config.loader import load_config
    from hybridflow.trainer.rl import train

    train(load_config(args.overrides, args.config))
    return 0


def _config(args: argparse.Namespace) -> int:
    """The resolved config, once it passes every check its command makes before any model loads (`check_config`)."""
    from hybridflow.config.follow import followed_comment
    from hybridflow.config.loader import to_yaml
    from hybridflow.trainer.preflight import check_config

    cfg = check_config(args.command_checked, args.overrides, args.config, checks=not args.no_checks)
    print(followed_comment(cfg) + to_yaml(cfg), end="")
    return 0


def _report(args: argparse.Namespace) -> int:
    from hybridflow.report import ReportError, write_report

    try:
        print(write_report(args.run_dir, args.out))
    except ReportError as e:
        print(f"hybridflow report: {e}", file=sys.stderr)
        return 2
    return 0


def _view(args: argparse.Namespace) -> int:
    from hybridflow.report import ReportError
    from hybridflow.report.live import serve

    try:
        serve(args.run_dir, args.host, args.port)
    except ReportError as e:
        print(f"hybridflow view: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"hybridflow view needs aiohttp and plotly ({e}): pip install -c constraints.txt -e '.[view]'",
              file=sys.stderr)
        return 2
    return 0


def _serve(args: argparse.Namespace) -> int:
    try:
        from hybridflow.serve.config import ServeConfig, model_map
        from hybridflow.serve.http_api import serve
    except ImportError as e:
        print(f"hybridflow serve needs tinker and aiohttp ({e}): pip install -c constraints.txt -e '.[serve]'",
              file=sys.stderr)
        return 2
    try:
        import torch

        device = args.device if args.device != "auto" else "cuda" if torch.cuda.is_available() else "cpu"
        config = ServeConfig(model_map(args.model), device=device, checkpoint_dir=Path(args.checkpoint_dir),
                             merged_exports=args.merged_exports, micro_batch_tokens=args.micro_batch_tokens,
                             quantization=args.quantization, session_timeout_s=args.session_timeout_s,
                             max_num_seqs=args.max_num_seqs, sampler_dtype=args.sampler_dtype,
                             train_dtype=args.train_dtype,
                             kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len)
        serve(config, args.host, args.port, args.api_key)
    except ValueError as e:
        print(f"hybridflow serve: {e}", file=sys.stderr)
        return 2
    return 0


def _sft(args: argparse.Namespace) -> int:
    from hybridflow.config.loader import load_config
    from hybridflow.config.sft_schema import SFTConfig
    from hybridflow.trainer.sft_trainer import train_sft

    train_sft(load_config(args.overrides, args.config, schema=SFTConfig))
    return 0


def _dpo(args: argparse.Namespace) -> int:
    from hybridflow.config.loader import load_config
    from hybridflow.config.preference_schema import DPOConfig
    from hybridflow.trainer.preference_trainer import train_dpo

    train_dpo(load_config(args.overrides, args.config, schema=DPOConfig))
    return 0


def _rm(args: argparse.Namespace) -> int:
    from hybridflow.config.loader import load_config
    from hybridflow.config.preference_schema import RewardModelTrainConfig
    from hybridflow.trainer.preference_trainer import train_reward_model

    train_reward_model(load_config(args.overrides, args.config, schema=RewardModelTrainConfig))
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from hybridflow.config.migrate import migrate

    result = migrate(args.source)
    for warning in result.warnings:
        print(f"hybridflow migrate: warning: {warning}", file=sys.stderr)
    if args.out:
        Path(args.out).write_text(result.text)
        check = "" if result.command == "train" else f" --command {result.command}"
        print(f"wrote {args.out}; check it with: hybridflow config{check} --config {args.out}")
    else:
        print(result.text, end="")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from hybridflow.demo import run_demo

    s = run_demo(args.output_dir)
    print(f"held-out accuracy {s['accuracy_before_rl']:.1%} after SFT -> {s['accuracy_after_rl']:.1%} after RL "
          f"({s['minutes']:.1f} min); {args.output_dir}/summary.json")
    return 0


PASSTHROUGH_HELP = {"export": "write a checkpoint as a Hugging Face model directory"}


def build_parser() -> argparse.ArgumentParser:
    from hybridflow.config.model_schema import QUANTIZATIONS
    from hybridflow.serve.config import DTYPES

    parser = argparse.ArgumentParser(prog="hybridflow",
                                     description="Reinforcement-learning post-training of language models.")
    parser.add_argument("--version", action="store_true", help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    for name, fn, text in (("train", _train, "RL training (PPO, GRPO, RLOO, REINFORCE++, ReMax, DAPO ...)"),
                           ("config", _config, "check a training command's configuration with every check the "
                            "command makes before a model loads (data rows and output directory included), then "
                            "print it resolved")):
        p = sub.add_parser(name, help=text, description=text + ". Options are dotted key=value overrides; "
                           "see docs/config.md for every key.")
        p.add_argument("--config", help="a YAML recipe (e.g. recipes/grpo.yaml)")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. rollout.n=8 actor.lr=1e-6")
        if name == "config":
            p.add_argument("--command", dest="command_checked", choices=("train", "sft", "dpo", "rm"), default="train",
                           help="the command whose recipe this is (default train; sft, dpo or rm for those commands)")
            p.add_argument("--no-checks", action="store_true",
                           help="print the resolved config without the command's checks (a partial config: no "
                           "model or data yet); keys, types and choices are still checked")
        p.set_defaults(fn=fn)

    p = sub.add_parser("report", help="plots and an HTML page of a run's metrics, config and samples",
                       description="Writes PNG plots and one HTML page (default <run_dir>/report.html).")
    p.add_argument("run_dir", help="a run's trainer.output_dir (holding metrics.jsonl)")
    p.add_argument("--out", help="the HTML file to write (default <run_dir>/report.html)")
    p.set_defaults(fn=_report)

    p = sub.add_parser("view", help="a live page of a run: curves, samples token by token, trajectories",
                       description="Serves a page on 127.0.0.1 that follows the run's files as it trains "
                                   "(docs/tracking.md#the-live-run-page).")
    p.add_argument("run_dir", help="a run's trainer.output_dir")
    p.add_argument("--port", type=int, default=8765, help="port (default 8765; 0 = any free port)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.set_defaults(fn=_view)

    p = sub.add_parser("serve", help="a local Tinker-compatible training service for the tinker SDK",
                       description="Serves the Tinker REST API: LoRA and full-parameter training and sampling of "
                                   "local models, "
                                   "driven by the tinker SDK unchanged (docs/tinker.md).")
    p.add_argument("--model", action="append", required=True, metavar="[NAME=]PATH",
                   help="a base model: a local Hugging Face directory, served as NAME (default: PATH as written); "
                        "repeat for several")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--api-key", help="the key clients must send (tml-...); default: none checked")
    p.add_argument("--device", default="auto", help="where training and sampling run: cpu, cuda, or auto (default: "
                                                    "cuda when there is a GPU, else cpu)")
    p.add_argument("--checkpoint-dir", default="tinker_checkpoints",
                   help="where save_state writes training state and save_weights_external its Hugging Face "
                        "directories (default ./tinker_checkpoints)")
    p.add_argument("--merged-exports", action="store_true",
                   help="save_weights_external of a LoRA client writes the merged model (default: a peft adapter "
                        "directory)")
    p.add_argument("--micro-batch-tokens", type=int, default=None,
                   help="the most padded tokens (rows x longest row) one forward_backward pass holds; requests' "
                        "data are packed into micro-batches within it (0: one batch per call; default: what 0.3 of "
                        "the free device memory holds of the model's activations, set at each client's creation)")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none",
                   help="nf4: the bases' projections stored once in 4 bits (torchao NF4), shared by the LoRA clients "
                        "(QLoRA); full-parameter clients are then refused (default none: fp32)")
    p.add_argument("--session-timeout-s", type=float, default=300.0,
                   help="a session whose client sent no heartbeat (the SDK sends one every 10 s) for this long is "
                        "finished and its training clients' weights released; 0: never (default 300)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="sequences the sampling engine runs at once, across clients (default 64)")
    p.add_argument("--sampler-dtype", choices=DTYPES, default="auto",
                   help="the sampling engine's precision: bf16, fp32, or auto (default: bf16 on CUDA, fp32 on CPU, "
                        "where sampled log-probs equal the fp32 trainer's)")
    p.add_argument("--train-dtype", choices=DTYPES, default="auto",
                   help="the training clients' compute precision: bf16 (autocast over fp32 weights and optimizer "
                        "state), fp32, or auto (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--kv-cache-memory", type=float, default=0.3,
                   help="the fraction of free device memory the sampling engine's KV cache takes when it starts; "
                        "the rest is the training clients' (default 0.3)")
    p.add_argument("--max-model-len", type=int, default=0,
                   help="the sampling engine's tokens per sequence, prompt + sampled: a shorter one fits more "
                        "sequences in the cache (default 0: min(the model's context, 4096))")
    p.set_defaults(fn=_serve)

    for name, fn, text, docs, recipe in (
            ("sft", _sft, "supervised fine-tuning on chat data (loss on assistant tokens)", "sft.md", "sft.yaml"),
            ("dpo", _dpo, "preference optimisation of a policy on chosen/rejected pairs (DPO, IPO, SimPO, ORPO)",
             "preference.md", "preference/dpo.yaml"),
            ("rm", _rm, "Bradley-Terry reward-model training on chosen/rejected pairs (for reward.reward_model)",
             "preference.md", "preference/reward_model.yaml")):
        p = sub.add_parser(name, help=text, description=f"{text[:1].upper()}{text[1:]}. Options are dotted "
                           f"key=value overrides; see docs/{docs} for every key.")
        p.add_argument("--config", help=f"a YAML recipe (e.g. recipes/{recipe})")
        p.add_argument("overrides", nargs="*", metavar="key=value", help="e.g. optim.lr=1e-5 data.max_length=2048")
        p.set_defaults(fn=fn)

    p = sub.add_parser("migrate", help="a hybridflow recipe from a verl command line (.sh) or config (.yaml)",
                       description="Writes a recipe from a verl shell script running verl.trainer.main_ppo or a verl "
                       "YAML config: each key commented with its verl key, those it cannot carry listed with why "
                       "(docs/migrating_from_verl.md).")
    p.add_argument("source", help="a verl script (e.g. examples/grpo_trainer/run_qwen2-7b.sh) or YAML config")
    p.add_argument("--out", help="the recipe to write (default: print it)")
    p.set_defaults(fn=_migrate)

    p = sub.add_parser("demo", help="SFT then GRPO on a tiny model, offline, in minutes (make demo)",
                       description="Builds a tiny model, SFTs it on a string task, improves it with GRPO "
                       "and writes summary.json, metrics, TensorBoard logs and a report (docs/demo.md).")
    p.add_argument("--output-dir", default="outputs/demo", help="where everything is written")
    p.set_defaults(fn=_demo)

    # Commands that own their argument parsing; listed here so `hybridflow --help` shows them.
    for name, text in PASSTHROUGH_HELP.items():
        sub.add_parser(name, help=text, add_help=False)
    return parser


def _passthrough(name: str):
    """The `main(argv)` of a command that parses its own arguments."""
    if name == "export":
        from hybridflow.checkpoint import main_export

        return main_export
    raise KeyError(name)


def _stopped(command: str, e: Interrupted) -> int:
    """What a run stopped at once by a signal (`e`) says, as its last line; its exit code."""
    from hybridflow.controller.backends.process_start import stop_fork_server

    stop_fork_server()  # a fork server started just before the signal may still be importing, and printing
    what = ("the step under way was not saved, the run resumes from its last checkpoint" if e.second else
            "outside a training step, so nothing in progress was lost; the same command resumes from the "
            "last checkpoint, if there is one")
    print(f"hybridflow {command}: stopped at once by {'a second ' if e.second else ''}{e.signal_name}; {what}",
          file=sys.stderr)
    return e.exit_code


def _run(args: argparse.Namespace) -> int:
    """The command; the errors that mean "fix this first" are printed as one line and exit 2."""
    from hybridflow.checkpoint import CheckpointError, IncompatibleCheckpoint
    from hybridflow.config.validate import ConfigError
    from hybridflow.data.files import DataError
    from hybridflow.rewards.failures import RowsFailed
    from hybridflow.tracking.jsonl_logger import LogWriteError

    try:
        return args.fn(args)
    except (ConfigError, DataError, CheckpointError, IncompatibleCheckpoint, RowsFailed, LogWriteError) as e:
        print(f"hybridflow {args.command}: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in PASSTHROUGH_HELP:
        return _passthrough(argv[0])(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.version:
        from hybridflow import __version__

        print(__version__)
        return 0
    if not getattr(args, "fn", None):
        parser.print_help()
        return 0
    # light: before any heavy import
    from hybridflow.utils.stop_signals import Interrupted, Preempted, StopAtOnce, interruption

    try:
        with StopAtOnce():
            return _run(args)
    except Preempted as e:
        print(f"hybridflow {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except Interrupted as e:
        return _stopped(args.command, e)
    except Exception as e:  # noqa: BLE001 - re-raised unless a stop signal's unwinding caused it
        stop = interruption(e)
        if stop is None:
            raise
        return _stopped(args.command, stop)
    except KeyboardInterrupt:
        print(f"hybridflow {args.command}: interrupted; the run resumes from its last checkpoint", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
