"""Expert kernels: the grouped MLP (``grouped_mlp`` and its tile lists ``grouped_mlp_tiles``), the 4-bit grouped MLP
(``grouped_mlp_w4`` over the decode rules of ``w4``), the gated activation with FP8 quantization between DeepGEMM's
GEMMs (``gated_act``), the FP8 quantizers (``fp8``) and the row quantizer for FP8 experts (``quantize_rows``)."""
