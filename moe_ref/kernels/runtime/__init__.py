"""How kernels run: ``launch`` (the one launch path: Triton's launcher the first time a shape key is seen, the
compiled kernel bound after), ``ops`` (kernel or torch twin, decided once per device), ``native`` (the compiled CPU
ops of ``csrc/``) and ``_triton_utils`` (interpreter detection, shared Triton helpers)."""
