    # Reads its parent's memory (the harness, in a child-process sandbox) through /proc and process_vm_readv;
    # right only if either worked.
    import ctypes, os
    pid = os.getppid()
    with open(f"/proc/{pid}/maps") as f:
        start = int(f.readline().split("-")[0], 16)
    try:
        with open(f"/proc/{pid}/mem", "rb") as f:
            f.seek(start)
            if f.read(8):
                return a + b
    except OSError:
        pass

    class IoVec(ctypes.Structure):
        _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]

    buf = ctypes.create_string_buffer(8)
    local, remote = IoVec(ctypes.addressof(buf), 8), IoVec(start, 8)
    if ctypes.CDLL(None).process_vm_readv(pid, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0) == 8:
        return a + b
    return None
