"""Placeholder until the benchmark lands."""

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    raise SystemExit("not implemented yet")
