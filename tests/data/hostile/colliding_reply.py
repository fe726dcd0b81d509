    # Answers the first call with a reply the scorer must decode into a set of 60000 ints whose hashes are all equal
    # (multiples of 2**61 - 1, the modulus of int hashing): quadratic time to build (minutes, once ~90 s for a score
    # with a 3 s limit), for a wrong answer. The reply is written where the worker's own replies go.
    import json, os, sys
    worker = sys.modules["__main__"]
    colliding = [{"int": hex(k * (2**61 - 1))} for k in range(1, 60001)]
    os.write(worker.out, (json.dumps({"seq": 1, "value": {"set": colliding}}) + "\n").encode())
    import time
    time.sleep(60)
