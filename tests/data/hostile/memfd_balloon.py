    # Holds 384 MB (its address-space limit is 256 MB in the tests) in memfds: pages that limit does not count
    # once unmapped. Right only if it could (the first call fills them, the others find them held).
    import os
    global held
    if "held" not in globals():
        held = []
        for _ in range(24):
            fd = os.memfd_create("balloon")
            os.posix_fallocate(fd, 0, 16 << 20)  # its pages, allocated without a copy
            held.append(fd)
    return a + b
