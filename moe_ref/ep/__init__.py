"""Stage 4, the expert-parallel routed step, in data-flow order:

    options (every EP option resolved once) -> capacity (CapacityPlan: the buffer's exact layout)
      -> buffer (SymmetricBuffer from the plan) -> transport (picks local | symm | a2a)
      -> dispatch (the Dispatcher contract: dispatch -> DispatchHandle -> combine) with symm / a2a
      -> routed_step (modular: transport x experts; monolithic: a fused engine such as mega_deep_gemm)
         around which overflow runs the per-call agreement and the chunk loop

``distributed`` holds the group agreements, ``device_checks`` the input checks computed on the device."""
