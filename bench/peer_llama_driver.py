"""llama.cpp's side of bench_peers.py, run by the python of llama.cpp's own venv: measures when asked.

argv: GGUF path, threads, flash attention (0/1). Prints {"load_s": ...} once loaded, then for each
JSON line on stdin ({"prompt": ids, "decode": n, "prefill": ids}) one JSON line: decode tok/s
(greedy, the tokens after the first over their time) and prefill tok/s (the prefill ids evaluated
from an empty context). llama.cpp's AMX matmul crashes on Q8_0 on Xeons with AMX (upstream issue
20824), so the build leaves AMX out (bench/peer_install.py); use_extra_bufts=False keeps the extra
buffer types out of a build that has them too. Both types are run alike.
"""
import json
import sys
import time

import llama_cpp


def main() -> None:
    path, threads, flash = sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3]))
    start = time.perf_counter()
    llm = llama_cpp.Llama(model_path=path, n_ctx=4096, n_batch=512, n_threads=threads, n_threads_batch=threads,
                          flash_attn=flash, use_extra_bufts=False, verbose=False)
    print(json.dumps({"load_s": time.perf_counter() - start}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        llm.reset()
        times = []
        for _ in llm.generate(ask["prompt"], temp=0.0, top_k=1, reset=True):
            times.append(time.perf_counter())
            if len(times) == ask["decode"]:
                break
        decode = (len(times) - 1) / (times[-1] - times[0])
        llm.reset()
        start = time.perf_counter()
        llm.eval(ask["prefill"])
        prefill = len(ask["prefill"]) / (time.perf_counter() - start)
        print(json.dumps({"decode_tok_s": decode, "prefill_tok_s": prefill}), flush=True)


if __name__ == "__main__":
    main()
