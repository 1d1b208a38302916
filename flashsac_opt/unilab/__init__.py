"""UniLab-facing code: the adapter UniLab's runner drives, checkpoint conversion, the patch tool,
and placeholder G1 meshes for offline runs."""
