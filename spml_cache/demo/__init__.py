"""The demo: the whole pipeline on a generated dataset (`demo.run.run_demo`), and the generator of that dataset in
the real PASCAL VOC layout (`demo.data.make_demo_data`, which the tests use too).

Not a stage: like the command line it stands above the stages and calls each one's door in turn. Nothing is
imported here, so that `spml-cache make-demo-data` does not pay for the stages' imports.
"""
