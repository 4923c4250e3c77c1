"""dptrain: distributed differentially private training with the Muon family of optimizers."""

__version__ = "0.1.0"
