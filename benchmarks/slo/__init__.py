"""`switchyard bench slo`: does the stack keep its latency targets under load (issue 34)?

- `plan`: the mixes, the load levels, the targets and each variant's copy of the config;
- `levels`: one level's outcomes reduced to counts, percentiles and goodput; fleet samples;
- `verdict`: the oracle's best level, the issue's targets as PASS/FAIL checks;
- `tables`: the printed tables and progress lines;
- `stack`: `switchyard serve` as a child process, its tenants, a fleet watcher;
- `bench`: the run itself (capacity, the sweep per variant, the peers, the report).

docs/benchmarks/slo.md says how to run it and what each column means.
"""
