"""What a user types reaches the terminal as text: paths and names holding rich markup (`x[/]y`, `[bold]`) are
printed as typed, never parsed (a MarkupError after the work was done, or a bracketed part silently eaten).
`linear --out 'x[/]y'`: tests/test_linear_cli.py; the report's labels: tests/test_report_backbones.py."""

from cli_support import run_cli


def test_make_demo_data_and_extract_print_bracketed_paths_as_typed(tmp_path):
    done = run_cli("make-demo-data", "d[bold]ata", "--train", "8", "--test", "4", "--size", "32", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "under d[bold]ata" in done.stdout and "--root 'd[bold]ata'" in done.stdout  # the next command pastes
    done = run_cli("extract", "voc", "--root", "d[bold]ata", "--dry-run", "--weights", "none", "--out", "c[/]d.h5",
                   cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "dry run: c[/]d.h5" in done.stdout and not (tmp_path / "c[").exists()
