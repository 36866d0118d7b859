"""Runtime: the optimized module, its graph cache and the rewrite report."""

from amxopt.runtime.compare import max_abs_error
from amxopt.runtime.module import OptimizedModule, build_graph
from amxopt.runtime.report import KINDS, Entry, Report

__all__ = ["KINDS", "Entry", "OptimizedModule", "Report", "build_graph", "max_abs_error"]
