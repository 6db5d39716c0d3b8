"""The simulator: kvflow's real Scheduler on a discrete-event clock with a GPU cost model.

No torch here: it depends on kvflow.core, numpy, and (for plots and progress bars) matplotlib
and tqdm. See README.md ("Simulator") and BENCHMARKS.md for what it reports.
"""
from kvflow.sim.cost_model import CostConstants, CostModel
from kvflow.sim.hardware import GPUS, MODELS, GPUSpec, ModelShape, get_gpu, get_model
from kvflow.sim.metrics import summarize
from kvflow.sim.policies import POLICIES, scheduler_config
from kvflow.sim.simulator import SimResult, simulate
from kvflow.sim.workload import Workload, load_trace

__all__ = ["GPUS", "MODELS", "POLICIES", "CostConstants", "CostModel", "GPUSpec", "ModelShape",
           "SimResult", "Workload", "get_gpu", "get_model", "load_trace", "scheduler_config",
           "simulate", "summarize"]
