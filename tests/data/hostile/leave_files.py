    # Leaves files ({MARKER}-*) wherever it can write (its working directory, /tmp, /var/tmp, /dev/shm), and a thread
    # that keeps writing new ones after the function has returned; answers wrongly. The test looks for what is left.
    import os, threading, time
    places = [".", "/tmp", "/var/tmp", "/dev/shm"]

    def leave(n):
        for place in places:
            try:
                with open(os.path.join(place, f"{MARKER}-{n}"), "w") as f:
                    f.write("left")
            except OSError:
                pass

    def keep_writing():
        n = 1
        while True:
            leave(n)
            n += 1
            time.sleep(0.005)

    leave(0)
    threading.Thread(target=keep_writing, daemon=True).start()
    return a - b
