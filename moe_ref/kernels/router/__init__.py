"""Router kernels: the gate GEMM (``router_logits``), the fused top-k of every router family (``router_topk``) and
the device-side check of routing values (``routing_check``), each beside its torch twin ``<op>_ref``."""
