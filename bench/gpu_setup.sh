# Source on the GPU host in the staged tree, /tmp/gpu-stage/tree, once the last of bench/gpu_stage.py's calls has
# unpacked its parts into /tmp/gpu-stage: puts onnxruntime-gpu and the wheels in /tmp/site (once per host), installs
# wrk, and sets PYTHONPATH/PATH for this shell. The staged graphs are in /tmp/gpu-stage/cache, bench/gpu_check.py's
# default.
# (../shared/gpu/device-setup.sh, the staging of ../shared/gpu/stage.sh, with the project's own checks.)
if [ ! -f /tmp/site/.ready ]; then
    (
        set -e
        mkdir -p /tmp/site
        mv /tmp/gpu-stage/onnxruntime /tmp/gpu-stage/onnxruntime_gpu-*.dist-info /tmp/site/
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            /tmp/gpu-stage/whl/*.whl 2>&1 | grep -v WARNING || true
        install -m 755 /tmp/gpu-stage/wrk/wrk /usr/bin/wrk
        for lib in /tmp/gpu-stage/wrk/lib*; do
            [ -e "/usr/lib/x86_64-linux-gnu/$(basename "$lib")" ] || cp "$lib" /usr/lib/x86_64-linux-gnu/
        done
        ldconfig
        # the project's own metadata (importlib.metadata.version of the project) without installing it
        name=$(sed -n 's/^name *= *"\(.*\)"/\1/p' pyproject.toml | head -1)
        version=$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -1)
        mkdir -p "/tmp/site/$name-$version.dist-info"
        printf 'Metadata-Version: 2.1\nName: %s\nVersion: %s\n' "$name" "$version" \
            > "/tmp/site/$name-$version.dist-info/METADATA"
        touch /tmp/site/.ready
    ) || return 1
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PATH="/tmp/site/bin:$PATH" PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
