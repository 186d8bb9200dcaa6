"""The commands of `pipec` (pipec/cli.py gathers them), a module per kind of work: compiling
schedules, reading builds, planning; their shared text tables."""
