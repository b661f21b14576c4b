#!/usr/bin/env bash
# Makes .devcarry (ignored by git, .gitignore) for benchmarks/device_check.sh: what
# the device machine's image lacks, for its Python 3.12 on x86-64. Ray's wheel (79 MB) is over the 64 MiB a
# call carries, so it travels as an xz tarball of the package less its Java jars, dashboard front end, and the
# RLlib, Data, Train, Tune and LLM libraries (~28 MB); pdserve starts Ray without a dashboard.
set -euo pipefail
dest=.devcarry
rm -rf "$dest" && mkdir -p "$dest/tok" && tmp=$(mktemp -d)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" \
  gguf fastapi starlette pydantic pydantic-core annotated-types typing-inspection typing_extensions uvicorn \
  opentelemetry-api importlib-metadata lazy-importer grpcio==1.85.3 protobuf==7.36.2 grpcio-health-checking==1.85.1 \
  grpcio-reflection==1.85.1 jsonschema referencing rpds-py jsonschema-specifications
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 -d "$tmp" ray==2.60.0
(cd "$tmp" && unzip -q ray-*.whl && rm -rf ray/jars ray/dashboard/client/build ray/rllib ray/data ray/llm \
  ray/tests ray/train ray/tune && tar cf - ray ray-*.dist-info | xz -T0 -6 >ray-2.60.0-stripped.tar.xz)
mv "$tmp/ray-2.60.0-stripped.tar.xz" "$dest/" && rm -rf "$tmp"
# SmolLM2's tokenizer and config, from the HF directory pdserve made of the GGUF on first use
hf=${PDSERVE_CACHE_DIR:-$HOME/.cache/pdserve}/smollm2-135m/hf
cp "$hf"/{tokenizer.json,tokenizer_config.json,chat_template.jinja,config.json} "$dest/tok/"
du -sh "$dest"
