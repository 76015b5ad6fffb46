"""The benchmarks behind `python -m client bench ...` (one module per subcommand, bench_*.py),
their shared helpers (benchutil: tables, JSON reports, machine facts, busy cores), the
memory-bandwidth floors the decode reports compare against (floors), ISA capping (isa_caps) and
the speculation replay (spec_replay). The user clients (generate, chat, soak, the perf_analyzer
and genai-perf wrappers, the server runner) sit beside this package in client/; benchmarks may
use them, never the other way round."""
