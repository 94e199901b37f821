"""Drivers that execute the protocol machines: over a Communicator, or simulated."""

from refdcp.driver.run import StepRecord, drive
from refdcp.driver.simulator import Deadlock, Fault, InjectedFault, SimResult, simulate
from refdcp.driver.steps import LoadContext, SaveContext

__all__ = [
    "Deadlock",
    "Fault",
    "InjectedFault",
    "LoadContext",
    "SaveContext",
    "SimResult",
    "StepRecord",
    "drive",
    "simulate",
]
