"""`pipec plan`: which schedule, micro-batch size and memory strategy pays, before a large run.

The BPipe re-evaluation (Huang et al., 2024) found that balancing memory only pays when the
larger micro-batch it makes room for raises the kernels' efficiency (MFU). `pipec plan` measures
that curve on the local device (`profile_mbs`), prices every candidate's per-rank memory in
bytes (`memory`), simulates the ones that fit with the measured costs (`candidates`) and prints
them ranked beside the paper's quick estimate (`report`). The cost and memory model is
documented in docs/plan.md; `saved` keeps the profile on disk, and `build` turns a ranked
candidate into a runnable build of exactly the programs the plan simulated, through the
`pipec compile --plan-profile` command line each row carries.
"""
