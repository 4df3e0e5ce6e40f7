"""Wall time of DDTree on a tiny random Qwen3 target + DFlash drafter: plain load vs disk-offloaded placement
(accelerate device_map) vs flex attention, one CPU thread. Tokens must be identical in all three.

    python examples/placement_overhead.py
"""
import tempfile, time, torch
from spiffy.arspec import ddtree_generate
from spiffy.models import load_drafter, load_target, make_tiny_dflash, make_tiny_target
torch.set_num_threads(1)
root = tempfile.mkdtemp()
t = make_tiny_target(root + "/t", seed=3, num_layers=3, with_tokenizer=False)
d = make_tiny_dflash(root + "/d", t, seed=4, num_layers=2, block_size=8)
dm = {"model.embed_tokens": "disk", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "disk",
      "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "disk"}
targets = {"sdpa": load_target(t, torch.float32, "cpu"),
           "sdpa+disk-offload": load_target(t, torch.float32, device_map=dm, offload_folder=root + "/off"),
           "flex (unfused, CPU)": load_target(t, torch.float32, "cpu", attn_implementation="flex_attention")}
drafter = load_drafter(d, dtype=torch.float32)
prompt = [5, 6, 7, 8, 9, 10]
ref = None
for name, target in targets.items():
    ddtree_generate(target, drafter, prompt, budget=16, max_new_tokens=8)  # warm-up
    best = []
    for _ in range(3):
        r = ddtree_generate(target, drafter, prompt, budget=16, max_new_tokens=64)
        best.append(r.seconds)
    ref = ref or r.tokens
    print(f"{name}: {len(r.tokens)} tokens, {r.rounds} rounds, tau {r.tau:.2f}, best of 3 {min(best):.3f} s "
          f"({len(r.tokens) / min(best):.0f} tok/s), tokens identical to sdpa: {r.tokens == ref}")
