"""`python -m kvbridge ...` is the `kvbridge` console command."""

from kvbridge.cli import main

raise SystemExit(main())
