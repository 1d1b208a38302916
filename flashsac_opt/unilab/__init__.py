"""UniLab-facing code: the adapter UniLab's runner drives, checkpoint conversion, the patch tool."""
