"""`python -m spml_cache ...` behaves exactly like `spml-cache ...` (also under `torchrun -m spml_cache`)."""

from spml_cache.cli import main

if __name__ == "__main__":
    main()
