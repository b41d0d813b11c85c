from speculators.cli import main

raise SystemExit(main())
