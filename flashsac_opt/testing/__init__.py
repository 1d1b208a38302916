"""The oracle harness: UniLab's learner and flashsac_opt's side by side on the same batches."""
