"""The simulated executor and its step-time models.

The simulator runs the engine's real scheduler against a step-time model instead of a
model on a device: `SimulatedExecutor` keeps a runner's bookkeeping and a virtual clock,
`RooflineStepModel` prices a step from datasheet numbers, `CalibratedStepModel` from a
saved fit to real runs' steps.csv, and `kv_capacity` sizes the KV cache a device would hold.
The harness work around it lives in the workbench: the calibration fit in
`workloads/calibration.py`, the SLO rate search in `workloads/rate_search.py`.
"""

from engine.sim.calibrated import CalibratedStepModel
from engine.sim.executor import SimulatedExecutor, build_step_model
from engine.sim.hardware import HardwareProfile, measure_cpu_profile
from engine.sim.kv_capacity import KVCapacity, kv_bytes_per_token, kv_capacity
from engine.sim.model_counts import ParamCounts, load_arch
from engine.sim.roofline import RooflineStepModel
from engine.sim.step_batch import StepBatch, StepModel

__all__ = [
    "CalibratedStepModel",
    "HardwareProfile",
    "KVCapacity",
    "ParamCounts",
    "RooflineStepModel",
    "SimulatedExecutor",
    "StepBatch",
    "StepModel",
    "build_step_model",
    "kv_bytes_per_token",
    "kv_capacity",
    "load_arch",
    "measure_cpu_profile",
]
