"""EP data-path kernels over the symmetric buffer, each beside its torch twin ``<op>_ref``.

    pre_dispatch / ep_layout (counts, prefix sums) -> symm_signal (barrier) -> ep_dispatch (pull rows into the
    receive pool) -> experts -> ep_combine (push partials back, reduce in rank order); ep_chunk runs them in order.

``ep_regions`` is the buffer contract every kernel reads (offsets of each region); ``pool_rows`` maps pool rows to
their experts; ``ep_launch`` holds the launch shapes of the EP kernels.
"""
