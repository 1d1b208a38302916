"""Figure and table code shared by the experiments (run the scripts, not this package)."""
