"""The loop (``train``), its optimizer's parameter groups (``optim``) and its learning-rate schedule."""
