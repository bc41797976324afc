"""What the workbench and the reports both read: the run folder and the figures drawn from it.

Below `workloads/` (which runs experiments and writes run folders) and `reports/` (which reads
them, never running anything): the run folder's format (`runfolder.py`, `record.py`,
`step_members.py`), the summary metrics (`metrics.py`), SLO-miss attribution (`attribution.py`),
the steady-state window (`steady_state.py`), the statistics (`stats.py`) and the decomposition
of a change per output token (`explain.py`). Imports neither `workloads` nor `reports`
(tests/test_import_graph.py keeps it so).
"""
