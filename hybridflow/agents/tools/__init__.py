"""Tools: the `Tool` protocol (`tool`), the run's tools and one checked call (`toolset`), `<tool_call>`
parsing (`parsing`), and the built-ins: `calculator`, and the sandboxed `python` executor (`sandbox`; its
child process `sandbox_child` and kernel filter `sandbox_seccomp`)."""
