"""GRAFT inside other training frameworks: each subpackage wraps that framework's trainer, never copies it."""
