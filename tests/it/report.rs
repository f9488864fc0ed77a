//! `autotune report` and `tune --report`: one self-contained HTML page. A headless Chromium
//! renders it: the screenshot must be a real picture of the charts, and the DOM must hold every
//! regime's section and charts and the chosen setting.
//!
//! Without a Chromium on `PATH` (or in `AUTOTUNE_CHROMIUM`) the browser test is skipped, unless
//! `AUTOTUNE_REQUIRE_BROWSER=1` (CI sets it), which makes a missing browser a failure.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use autotune::profile::record::Profile;

use crate::util::{autotune, autotune_in, stderr, stdout};

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

const GPT_1_3B: &str = "profiles/recorded/rtx4090-32g-on-h200/gpt-1.3b.json";

/// The browser to render with: `AUTOTUNE_CHROMIUM`, else the first Chromium on `PATH`.
fn chromium() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("AUTOTUNE_CHROMIUM") {
        return Some(PathBuf::from(path));
    }
    let names = [
        "chromium",
        "chromium-browser",
        "google-chrome",
        "google-chrome-stable",
    ];
    std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default())
        .flat_map(|dir| names.iter().map(move |n| dir.join(n)))
        .find(|p| p.is_file())
}

/// The browser, or `None` to skip; a failure when `AUTOTUNE_REQUIRE_BROWSER=1`.
fn browser_or_skip() -> Option<PathBuf> {
    let found = chromium();
    if found.is_none() {
        if std::env::var("AUTOTUNE_REQUIRE_BROWSER").as_deref() == Ok("1") {
            panic!("AUTOTUNE_REQUIRE_BROWSER=1 but no chromium on PATH (install Debian's `chromium`, or set AUTOTUNE_CHROMIUM)");
        }
        eprintln!("skipped: no chromium on PATH; set AUTOTUNE_REQUIRE_BROWSER=1 to fail instead");
    }
    found
}

/// Runs headless Chromium on `page` with `args`, in a fresh profile, for at most two minutes.
fn headless(browser: &Path, page: &Path, args: &[String]) -> Output {
    let profile = tempfile::tempdir().unwrap();
    let mut child = Command::new(browser)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .args(args)
        .arg(format!("file://{}", page.display()))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chromium starts");
    let deadline = Instant::now() + Duration::from_secs(120);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("chromium did not finish within two minutes");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// Pixels of a PNG as RGB triples, with its size.
fn decode(png_file: &Path) -> (u32, u32, Vec<[u8; 3]>) {
    let bytes = std::fs::read(png_file).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "a PNG file");
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut buffer = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buffer).unwrap();
    let channels = info.color_type.samples();
    assert!(channels >= 3, "a colour image");
    let pixels = buffer[..info.buffer_size()]
        .chunks_exact(channels)
        .map(|p| [p[0], p[1], p[2]])
        .collect();
    (info.width, info.height, pixels)
}

/// Pixels within a few levels of `rgb` (anti-aliasing blends the edges of what is drawn).
fn near(pixels: &[[u8; 3]], rgb: [u8; 3]) -> usize {
    pixels
        .iter()
        .filter(|p| (0..3).all(|i| p[i].abs_diff(rgb[i]) <= 6))
        .count()
}

#[test]
fn a_headless_browser_renders_the_charts_and_finds_every_regime_and_the_plan() {
    let Some(browser) = browser_or_skip() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let page = dir.path().join("report.html");
    let out = autotune(&[
        "report",
        repo(GPT_1_3B).to_str().unwrap(),
        "--out",
        page.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let profile = Profile::load(&repo(GPT_1_3B)).unwrap();
    let mut regimes: Vec<_> = profile
        .trials
        .iter()
        .map(|t| t.request.knobs.regime())
        .collect();
    regimes.sort();
    regimes.dedup();

    // The DOM as the browser built it.
    let dom = headless(&browser, &page, &["--dump-dom".to_string()]);
    let dom = String::from_utf8_lossy(&dom.stdout).into_owned();
    assert!(dom.contains("<section id=\"plan\">"), "{dom}");
    assert_eq!(
        dom.matches("<section class=\"regime").count(),
        regimes.len()
    );
    assert_eq!(
        dom.matches("class=\"chart memory gpu\"").count(),
        regimes.len()
    );
    assert_eq!(
        dom.matches("class=\"chart memory host\"").count(),
        regimes.len()
    );
    for regime in &regimes {
        assert!(
            dom.contains(&format!("data-regime=\"{regime}\"")),
            "{regime}"
        );
    }
    let chosen = profile.chosen.unwrap().to_string();
    let plan = dom.split("<section id=\"plan\">").nth(1).unwrap();
    assert!(plan.split("</section>").next().unwrap().contains(&chosen));
    assert!(dom.contains("<section class=\"regime chosen\""));
    assert!(!dom.contains("<script"));

    // The picture: a PNG of the window's size, mostly page, with the charts' colours in it.
    let shot = dir.path().join("shot.png");
    let out = headless(
        &browser,
        &page,
        &[
            format!("--screenshot={}", shot.display()),
            "--window-size=1280,1800".to_string(),
        ],
    );
    assert!(
        shot.is_file(),
        "no screenshot: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (width, height, pixels) = decode(&shot);
    assert_eq!((width, height), (1280, 1800));
    let white = near(&pixels, [255, 255, 255]);
    assert!(white < pixels.len() * 97 / 100, "a blank page");
    let mut colours: Vec<[u8; 3]> = pixels.clone();
    colours.sort_unstable();
    colours.dedup();
    assert!(
        colours.len() > 100,
        "only {} colours: not a rendered page",
        colours.len()
    );
    // The budget lines (red), the measured GPU peaks (blue) and the text (near black).
    assert!(near(&pixels, [0xc5, 0x30, 0x30]) > 300, "no budget lines");
    assert!(
        near(&pixels, [0x2b, 0x6c, 0xb0]) > 100,
        "no measured GPU peaks"
    );
    assert!(near(&pixels, [0x1d, 0x24, 0x30]) > 1000, "no text");
}

#[test]
fn report_reads_plans_and_profiles_and_refuses_anything_else_naming_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let backend = format!("replay:{}", repo(GPT_1_3B).display());
    // tune --report: the search's page, beside its plan.
    let out = autotune_in(
        dir.path(),
        &[
            "tune",
            "--backend",
            &backend,
            "--out",
            "plan.json",
            "--report",
            "search.html",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let search = std::fs::read_to_string(dir.path().join("search.html")).unwrap();
    assert!(
        search.contains("<table class=\"alternatives\">") || search.contains("no other feasible")
    );
    assert!(
        search.contains("model error (leave-one-out)"),
        "the plan's choice"
    );

    // From the plan alone, on stdout.
    let out = autotune_in(dir.path(), &["report", "plan.json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let page = stdout(&out);
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert!(page.contains("model error (leave-one-out)"));
    assert_eq!(
        page.matches("<section class=\"regime").count(),
        search.matches("<section class=\"regime").count()
    );

    // Not a plan or a profile, or no file at all: exit 2 naming it.
    std::fs::write(dir.path().join("model.json"), r#"{"preset": "tiny"}"#).unwrap();
    for (file, says) in [
        ("model.json", "invalid plan"),
        ("missing.json", "cannot read"),
    ] {
        let out = autotune_in(dir.path(), &["report", file, "--out", "x.html"]);
        assert_eq!(out.status.code(), Some(2), "{file}");
        assert!(
            stderr(&out).contains(file) && stderr(&out).contains(says),
            "{}",
            stderr(&out)
        );
        assert!(!dir.path().join("x.html").exists());
    }
}

#[test]
fn a_metrics_log_is_drawn_as_its_loss_curves_and_a_broken_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let out = autotune_in(
        dir.path(),
        &[
            "train",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--micro-batch",
            "2",
            "--steps",
            "6",
            "--metrics",
            "metrics.jsonl",
        ],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let out = autotune_in(
        dir.path(),
        &["report", "metrics.jsonl", "--out", "curves.html"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(stderr(&out).contains("6 steps"), "{}", stderr(&out));
    let page = std::fs::read_to_string(dir.path().join("curves.html")).unwrap();
    assert!(page.starts_with("<!DOCTYPE html>"));
    assert_eq!(
        page.matches("<svg").count(),
        3,
        "loss, learning rate, speed"
    );
    assert!(page.contains("6 steps; training loss"), "the summary");

    // A log cut mid-line is exit 2 naming the file and the line.
    let log = std::fs::read_to_string(dir.path().join("metrics.jsonl")).unwrap();
    let cut = &log[..log.len() - 20];
    std::fs::write(dir.path().join("cut.jsonl"), cut).unwrap();
    let out = autotune_in(dir.path(), &["report", "cut.jsonl", "--out", "x.html"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("cut.jsonl") && stderr(&out).contains("line 6"),
        "{}",
        stderr(&out)
    );
    assert!(!dir.path().join("x.html").exists());
}
