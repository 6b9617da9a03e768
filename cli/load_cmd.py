"""`switchyard load`: an open-loop load generator against the running stack."""

import argparse


def add_load_parser(sub: argparse._SubParsersAction) -> None:
    pass
