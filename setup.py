"""Build hook. Metadata lives in pyproject.toml; compiled parts are added here."""
from setuptools import setup

setup()
