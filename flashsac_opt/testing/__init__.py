"""Test and experiment harnesses: the oracle (UniLab's learner and flashsac_opt side by side on
the same batches) and a backend that records what each backward keeps (saved_tensors)."""
