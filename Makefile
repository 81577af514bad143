# Everything runs from a project-local virtual environment that the first target builds.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install test test-slow serve models demo-data demo-weights lock proto clean gpu-check perf-analyzer

# RUNTIME=cpu (plain onnxruntime) or RUNTIME=gpu (onnxruntime-gpu with CUDA 13, cuDNN 9 and GPU decoding).
# The two share a module name and break each other, so the other one goes first.
# The default is what .venv already has (cpu in a new checkout): naming the other one swaps it.
RUNTIME ?= $(shell cat $(VENV)/.runtime 2>/dev/null || echo cpu)
OTHER_ORT := $(if $(filter gpu,$(RUNTIME)),onnxruntime,onnxruntime-gpu)
# Everything (`make install`, so the tests): the runtime, training and export, the load tester, Ray and the test tools
$(VENV)/.installed-$(RUNTIME): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip uninstall --quiet --yes $(OTHER_ORT) 2>/dev/null || true
	$(BIN)/pip install --quiet --constraint requirements.lock --editable '.[$(RUNTIME),train,test,loadtest,ray,tracing]'
	rm -f $(VENV)/.installed* $(VENV)/.serving*
	echo $(RUNTIME) > $(VENV)/.runtime
	touch $(VENV)/.serving-$(RUNTIME) $@

# Serving alone (`make serve`): the web stack and one ONNX Runtime, no torch, Ray or test tools (about 20 s on a
# fresh machine). A full install has it too.
$(VENV)/.serving-$(RUNTIME): pyproject.toml requirements.lock
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip uninstall --quiet --yes $(OTHER_ORT) 2>/dev/null || true
	$(BIN)/pip install --quiet --constraint requirements.lock --editable '.[$(RUNTIME)]'
	rm -f $(VENV)/.installed* $(VENV)/.serving*
	echo $(RUNTIME) > $(VENV)/.runtime
	touch $@

install: $(VENV)/.installed-$(RUNTIME)

# ruff first (pyproject's [tool.ruff]); then the test files spread over every core, each file in one worker (its
# module fixtures built once): on 2 cores the suite takes 0.63x the time of one worker (docs/development.md#tests).
# TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= $(shell nproc)
test: install perf-analyzer
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q --numprocesses $(TEST_WORKERS) --dist loadfile

# Triton's perf_analyzer (tritonclient 2.40.0's binary) in build/perf_analyzer/, for tests/test_perf_analyzer.py and
# bench/perf_analyzer.py; it starts where Debian's libb64-0d is installed (.ci/run installs it), else its test skips
PERF_ANALYZER := build/perf_analyzer/perf_analyzer
$(PERF_ANALYZER):
	-$(PYTHON) bench/perf_analyzer.py install  # (a failure here skips the test, saying why)

perf-analyzer: $(PERF_ANALYZER)

test-slow: install
	$(BIN)/python -m pytest -q -m slow

# On a GPU host (docs/development.md#the-gpu-check): the CUDA tests, the service under wrk, the graphs, decoding, a
# census, a profile, an op profile, the JPEG engines and the relevance maps' cost, each part in its time box (470 s
# in all), into bench/results/ (GPU_CHECK_OUT elsewhere: the device's $OUT). No venv there and no package index:
# python3 with the PYTHONPATH that bench/gpu_setup.sh sets, from the parts bench/gpu_stage.py packed here. Its
# stderr too goes to stdout.
GPU_CHECK_OUT ?= bench/results
gpu-check:
	$(PYTHON) bench/gpu_check.py --out $(GPU_CHECK_OUT) 2>&1

# The embedded demo models: synthetic data, then one training run each and, for the ViT and Swin, two epochs more
# with two-shape scenes, then multi-label epochs for the ViT and the DeiT (from the ViT, distilled from the Swin), and
# the embedded CLIP (about 4 h on 2 CPU cores; the ViT and Swin runs can run side by side with OMP_NUM_THREADS=1 each).
# The commands are recorded in each models/demo/*/summary.json with the held-out accuracy.
DEMO := models/demo
SHAPES := data/shapes
FACES := data/faces
RECIPE := --lr 1e-3 --warmup-epochs 1 --crop-scale 0.85 --jitter 0.1 --drop-path 0.05
TWO_SHAPES := --epochs 2 --batch-size 16 --two-shapes 16 --lr 3e-4 --warmup-epochs 0.1 --crop-scale 0.85 --jitter 0.1 \
	--drop-path 0.05

# The service on the embedded model repository (settings: VITSERVE_* variables, see README).
serve: $(VENV)/.serving-$(RUNTIME)
	$(BIN)/python -m service

# Rebuild the embedded model repository from the committed demo weights. The held-out splits (the same
# images the demo runs were scored on) feed the int8 gate, the CPU plans' gates (--precision auto: OpenVINO fp32 and
# bf16, int8 on both runtimes, the bf16 ones verified only on a CPU that has bf16) and the accuracies in the manifests.
REPO := model_repository
EXPORT := $(BIN)/python -m export
models: install
	$(BIN)/python -m models.synthetic shapes --out $(SHAPES) --train 0 --val 1200 --seed 0
	$(BIN)/python -m models.synthetic faces --out $(FACES) --train 0 --val 1400 --seed 0
	$(EXPORT) vit_micro_patch8_96 --weights $(DEMO)/vit_micro_patch8_96/model.safetensors --name shapes-vit \
		--precision auto --eval-data $(SHAPES)/val --out $(REPO)
	$(EXPORT) vit_micro_patch8_96 --weights $(DEMO)/vit_micro_patch8_96/model.safetensors --name shapes-vit-int8 \
		--precision int8 --no-explain --eval-data $(SHAPES)/val --out $(REPO)
	$(EXPORT) deit_micro_distilled_patch8_96 --weights $(DEMO)/deit_micro_distilled_patch8_96/model.safetensors \
		--name shapes-deit --precision auto --eval-data $(SHAPES)/val --out $(REPO)
	$(EXPORT) swin_micro_patch4_window6_96 --weights $(DEMO)/swin_micro_patch4_window6_96/model.safetensors \
		--name shapes-swin --precision auto --eval-data $(SHAPES)/val --out $(REPO)
	$(EXPORT) vit_micro_patch16_fer_112 --weights $(DEMO)/vit_micro_patch16_fer_112/model.safetensors \
		--name expression-vit --precision auto --eval-data $(FACES)/val --out $(REPO)
	$(EXPORT) mini_xception_fer2013_64 --weights models/pretrained/mini_xception_fer2013.safetensors \
		--name expression-fer2013 --out $(REPO)
	$(EXPORT) $(DEMO)/shapes-clip --name shapes-clip --out $(REPO)
	$(EXPORT) mtcnn --out $(REPO)

demo-data: install
	$(BIN)/python -m models.synthetic shapes --out $(SHAPES) --train 20000 --val 1200 --seed 0
	$(BIN)/python -m models.synthetic faces --out $(FACES) --train 14000 --val 1400 --seed 0

demo-weights: demo-data
	$(BIN)/python -m models.train vit_micro_patch16_fer_112 --data $(FACES) --out $(DEMO)/vit_micro_patch16_fer_112 --epochs 30 --batch-size 64 $(RECIPE)
	$(BIN)/python -m models.train vit_micro_patch8_96 --data $(SHAPES) --out $(DEMO)/vit_micro_patch8_96 --epochs 10 --batch-size 32 $(RECIPE)
	$(BIN)/python -m models.train swin_micro_patch4_window6_96 --data $(SHAPES) --out $(DEMO)/swin_micro_patch4_window6_96 --epochs 10 --batch-size 32 $(RECIPE)
	# then 2 epochs from those weights with 16 scenes of two shapes added to every batch, half each label: models that
	# saw one shape an image had no answer for two, and their maps of either label spread over both (docs/attention.md)
	for m in vit_micro_patch8_96 swin_micro_patch4_window6_96; do \
		$(BIN)/python -m models.train $$m --data $(SHAPES) --out $(DEMO)/$$m --weights $(DEMO)/$$m/model.safetensors $(TWO_SHAPES) \
			|| exit 1; \
	done
	# then 2 epochs more for the ViT, each label scored on its own (a sigmoid each, binary cross-entropy, a scene's two
	# labels both present): relevance maps of each label on its own shape (docs/attention.md); and the served DeiT is
	# 2 such epochs, distilled from the Swin, started from that ViT (its distillation token and head begin as [CLS]'s)
	$(BIN)/python -m models.train vit_micro_patch8_96 --data $(SHAPES) --out $(DEMO)/vit_micro_patch8_96 \
		--weights $(DEMO)/vit_micro_patch8_96/model.safetensors $(TWO_SHAPES) --multi-label
	$(BIN)/python -m models.train deit_micro_distilled_patch8_96 --data $(SHAPES) --out $(DEMO)/deit_micro_distilled_patch8_96 \
		--weights $(DEMO)/vit_micro_patch8_96/model.safetensors $(TWO_SHAPES) --multi-label \
		--teacher $(DEMO)/swin_micro_patch4_window6_96/model.safetensors
	# the embedded CLIP, its image tower started from the shapes ViT (a CLIPModel folder: models/shapes_clip.py)
	$(BIN)/python -m models.shapes_clip --out $(DEMO)/shapes-clip
	rm -f $(DEMO)/*/checkpoint.pt

# requirements.lock: every dependency of every extra, resolved together for Linux x86-64 and Python 3.11,
# both ONNX Runtimes at one version. `make install` (so CI) and the Docker images install within it.
ORT_VERSION ?= 1.31.1
lock:
	mkdir -p build
	printf 'onnxruntime==$(ORT_VERSION)\nonnxruntime-gpu==$(ORT_VERSION)\n' > build/ort.txt
	$(PYTHON) -m pip install --quiet --dry-run --ignore-installed --constraint build/ort.txt \
		--report build/resolved.json '.[cpu,gpu,train,test,loadtest,ray,tracing]'
	$(PYTHON) -c 'import json, sys; \
		found = [f["metadata"] for f in json.load(open(sys.argv[1]))["install"]]; \
		pins = ["%s==%s" % (p["name"], p["version"].split("+")[0]) for p in found if p["name"] != "vitserve"]; \
		print("# Every dependency pinned, as pip constraints. Renew with `make lock` (see the Makefile)."); \
		print(*sorted(pins, key=str.lower), sep="\n")' build/resolved.json > requirements.lock

# service/protocol/open_inference_pb2.py(i) from the .proto beside it, committed: serving needs no compiler.
# grpcio-tools lives in a venv of its own (it brings its own protobuf); the generated module needs protobuf >= the
# version it was generated with.
PROTO := service/protocol/open_inference.proto
proto:
	$(PYTHON) -m venv build/proto
	build/proto/bin/pip install --quiet grpcio-tools==1.85.1
	build/proto/bin/python -m grpc_tools.protoc -I. --python_out=. --pyi_out=. $(PROTO)

clean:
	rm -rf $(VENV) build *.egg-info
