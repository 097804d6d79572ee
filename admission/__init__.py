from admission.gate import AdmissionGate, Rejection
from admission.ledger import AdmissionLedger, AdmissionShare, ReplicaReport
from admission.sync import AdmissionSync

__all__ = ["AdmissionGate", "AdmissionLedger", "AdmissionShare", "AdmissionSync", "Rejection", "ReplicaReport"]
