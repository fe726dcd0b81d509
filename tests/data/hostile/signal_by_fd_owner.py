    # Makes the kernel signal its scorer (its parent, in a child-process sandbox) for it: a pipe's owner set to the
    # scorer's pid (fcntl F_SETOWN, F_SETOWN_EX, F_SETOWN with bits above the 32 the kernel reads; ioctl FIOSETOWN)
    # with SIGKILL as its I/O signal (F_SETSIG; else SIGIO, which ends a process too), then a byte written; answers
    # wrongly, so that only a dead scorer could keep it from failing.
    import ctypes, fcntl, os, struct
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    target = os.getppid()
    fcntl_number = {"x86_64": 72, "aarch64": 25}.get(os.uname().machine)

    def own(fd, how):
        if how == "F_SETOWN":
            return fcntl.fcntl(fd, 8, target) == 0
        if how == "F_SETOWN_EX":
            return fcntl.fcntl(fd, 15, struct.pack("ii", 1, target)) is not None  # F_OWNER_PID
        if how == "F_SETOWN high":
            return fcntl_number is not None and libc.syscall(
                ctypes.c_long(fcntl_number), ctypes.c_long(fd), ctypes.c_long((1 << 32) | 8), ctypes.c_long(target)) == 0
        return libc.ioctl(fd, 0x8901, ctypes.byref(ctypes.c_int(target))) == 0  # FIOSETOWN

    for how in ("F_SETOWN", "F_SETOWN_EX", "F_SETOWN high", "FIOSETOWN"):
        r, w = os.pipe()
        try:
            if not own(r, how):
                continue
        except OSError:
            continue
        try:
            fcntl.fcntl(r, 10, 9)  # F_SETSIG: SIGKILL
        except OSError:
            pass
        fcntl.fcntl(r, fcntl.F_SETFL, os.O_ASYNC | os.O_NONBLOCK)
        os.write(w, b"x")
    return a - b
