"""Host memory of flaxgpt.hf.pretrained.load_pretrained: the peak extra anonymous RSS over the file size.

    python benchmarks/hf_load_memory.py                    # gpt2 (124M), gpt2-medium (350M), both layouts
    python benchmarks/hf_load_memory.py --sizes gpt2-xl    # 6.4 GB of disk and ~7 GB of RAM

Writes a GPT-2 of each size with constant weights (a real checkpoint's layout and shapes, no
download) to a temporary directory, loads it in a fresh process per case on the CPU, and samples
/proc/self/status every 2 ms. Linux only (RssAnon).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, sys, threading, time
import jax, jax.numpy as jnp
from flaxgpt.hf import pretrained as hf

def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024

directory, scan = sys.argv[1], sys.argv[2] == "1"
jnp.zeros(1).block_until_ready()
base, peak, done = anon(), [0], [False]

def watch():
    while not done[0]:
        peak[0] = max(peak[0], anon())
        time.sleep(0.002)

thread = threading.Thread(target=watch)
thread.start()
t0 = time.perf_counter()
config, params = hf.load_pretrained(directory, scan_layers=scan)
jax.block_until_ready(params)
seconds = time.perf_counter() - t0
done[0] = True
thread.join()
print(json.dumps({"peak": peak[0] - base, "final": anon() - base, "seconds": seconds}))
"""


def write_checkpoint(directory: str, name: str) -> int:
    import numpy as np
    from safetensors.numpy import save_file

    from flaxgpt.models.gpt import GPTConfig

    p = GPTConfig.PRESETS[name]
    L, D = p["n_layer"], p["n_embd"]
    block = {"ln_1.weight": (D,), "ln_1.bias": (D,), "attn.c_attn.weight": (D, 3 * D),
             "attn.c_attn.bias": (3 * D,), "attn.c_proj.weight": (D, D), "attn.c_proj.bias": (D,),
             "ln_2.weight": (D,), "ln_2.bias": (D,), "mlp.c_fc.weight": (D, 4 * D), "mlp.c_fc.bias": (4 * D,),
             "mlp.c_proj.weight": (4 * D, D), "mlp.c_proj.bias": (D,)}  # fmt: skip
    tensors = {"wte.weight": np.full((50257, D), 0.01, "f4"), "wpe.weight": np.full((1024, D), 0.01, "f4"),
               "ln_f.weight": np.ones(D, "f4"), "ln_f.bias": np.zeros(D, "f4")}  # fmt: skip
    for i in range(L):
        for key, shape in block.items():
            tensors[f"h.{i}.{key}"] = np.full(shape, 0.01, "f4")
    path = os.path.join(directory, "model.safetensors")
    save_file(tensors, path)
    with open(os.path.join(directory, "config.json"), "w") as fh:
        json.dump({"model_type": "gpt2", "n_layer": L, "n_head": p["n_head"], "n_embd": D}, fh)
    return os.path.getsize(path)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", nargs="+", default=["gpt2", "gpt2-medium"])
    args = parser.parse_args()
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    print("| model | file MiB | layout | peak extra RSS MiB | peak / file | load s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in args.sizes:
        with tempfile.TemporaryDirectory() as directory:
            size = write_checkpoint(directory, name)
            for scan in (False, True):
                out = subprocess.run([sys.executable, "-c", CHILD, directory, str(int(scan))], env=env,
                                     capture_output=True, text=True, check=True)  # fmt: skip
                r = json.loads(out.stdout.strip().splitlines()[-1])
                layout = "scan_layers" if scan else "h_0..h_L"
                print(f"| {name} | {size / 2**20:.0f} | {layout} | {r['peak'] / 2**20:.0f} | "
                      f"{r['peak'] / size:.2f}x | {r['seconds']:.1f} |")  # fmt: skip


if __name__ == "__main__":
    main()
