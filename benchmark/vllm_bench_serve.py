"""Run vLLM's `vllm bench serve` without its CLI entry point (which needs the `vllm` distribution name)."""
import argparse
import sys

from vllm.benchmarks import serve

parser = argparse.ArgumentParser()
serve.add_cli_args(parser)
serve.main(parser.parse_args(sys.argv[1:]))
