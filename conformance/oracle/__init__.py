"""The reference implementation: what FSDP promises, computed from a CaseSpec alone."""

from conformance.oracle.fsdp1 import FSDP1Prediction, UnitPrediction, predict_fsdp1

__all__ = ["FSDP1Prediction", "UnitPrediction", "predict_fsdp1"]
