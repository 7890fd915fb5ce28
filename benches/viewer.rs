//! `stepppo view` under load, over real HTTP on loopback: time to open a dataset (map, scan,
//! build the summary index), to walk every page of the trajectory list, to answer a new sorted
//! selection, and page latency
//! p50/p99 with 8 concurrent clients asking for random list pages (random sort) and random
//! trajectory pages. Bounded: at most `VIEWER_BENCH_REQUESTS` (400) concurrent requests in all.
//!
//! ```text
//! cargo bench --bench viewer                                   # a 2,000-episode dataset it collects
//! VIEWER_BENCH_DATASET=/tmp/fl-1m cargo bench --bench viewer    # an existing dataset or run dir
//! ```

use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use stepppo::env::AgentKind;
use stepppo::store::{self, CollectConfig, Dataset, DatasetWriter, WriterOptions};
use stepppo::tokenizer::Tokenizer;
use stepppo::view::{self, ViewOptions};

const CLIENTS: usize = 8;
const PER_PAGE: usize = 500;

fn dataset() -> (PathBuf, Option<tempfile::TempDir>) {
    if let Some(path) = std::env::var_os("VIEWER_BENCH_DATASET") {
        return (PathBuf::from(path), None);
    }
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("ds");
    let cfg = CollectConfig {
        env: "frozen_lake".into(),
        env_config: serde_json::json!({}),
        agent: AgentKind::Random,
        episodes: 2000,
        group_size: 8,
        seed: 0,
    };
    let mut writer = DatasetWriter::create(&path, WriterOptions::default()).expect("create");
    store::collect(&cfg, &Tokenizer::builtin(), &mut writer).expect("collect");
    writer.seal().expect("seal");
    (path, Some(dir))
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(60)))
        .build()
        .into()
}

fn get(agent: &ureq::Agent, url: &str) -> (Duration, String) {
    let t = Instant::now();
    let mut resp = agent.get(url).call().expect("GET");
    assert_eq!(resp.status().as_u16(), 200, "{url}");
    let body = resp.body_mut().read_to_string().expect("body");
    (t.elapsed(), body)
}

fn rss_anon_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kb = status
        .lines()
        .find_map(|l| l.strip_prefix("RssAnon:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .unwrap_or(f64::NAN);
    kb / 1024.0
}

fn percentile(sorted: &[Duration], p: f64) -> f64 {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i].as_secs_f64() * 1e3
}

fn main() {
    let (path, _keep) = dataset();
    let ds = Dataset::open(&path.join("dataset"))
        .or_else(|_| Dataset::open(&path))
        .expect("open");
    let bytes: u64 = ds
        .segments()
        .map(|s| std::fs::metadata(&s.path).map_or(0, |m| m.len()))
        .sum();
    let records = ds.len();
    drop(ds);
    let rss_before = rss_anon_mb();
    let t = Instant::now();
    let viewer = view::start(&ViewOptions {
        path: path.clone(),
        host: "127.0.0.1".into(),
        port: 0,
    })
    .expect("start");
    let open = t.elapsed();
    let base = format!("http://{}", viewer.addr());
    println!(
        "dataset {}: {records} records, {:.1} MB; open (map + scan + index): {:.3} s; anonymous memory +{:.1} MB",
        path.display(),
        bytes as f64 / 1e6,
        open.as_secs_f64(),
        rss_anon_mb() - rss_before
    );

    let agent = agent();
    let (first, body) = get(&agent, &format!("{base}/trajectories?per_page={PER_PAGE}"));
    let pages: usize = body
        .split(" of ")
        .nth(1)
        .and_then(|s| s.split('<').next())
        .and_then(|s| s.trim().parse().ok())
        .expect("page count");
    let t = Instant::now();
    for page in 2..=pages {
        get(
            &agent,
            &format!("{base}/trajectories?per_page={PER_PAGE}&page={page}"),
        );
    }
    let walk = t.elapsed() + first;
    println!(
        "walk all {pages} list pages of {PER_PAGE}: {:.2} s ({:.1} ms a page)",
        walk.as_secs_f64(),
        walk.as_secs_f64() * 1e3 / pages as f64
    );
    for sort in ["return", "length"] {
        let (took, _) = get(
            &agent,
            &format!("{base}/trajectories?sort={sort}&order=desc"),
        );
        println!(
            "a new selection (every trajectory, sorted by {sort}): {:.1} ms",
            took.as_secs_f64() * 1e3
        );
    }
    concurrent(&base, pages);
}

/// Random list and trajectory pages from [`CLIENTS`] threads at once (trajectory ids are
/// drawn from 0..trajectories, as `collect` numbers them).
fn concurrent(base: &str, pages: usize) {
    let requests: usize = std::env::var("VIEWER_BENCH_REQUESTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    let status: serde_json::Value =
        serde_json::from_str(&get(&agent(), &format!("{base}/api/status")).1).expect("status");
    let trajs = status["trajectories"]
        .as_u64()
        .expect("trajectories")
        .max(1);
    let deadline = Instant::now() + Duration::from_secs(300);
    let sorts = ["id", "return", "length", "group"];
    let handles: Vec<_> = (0..CLIENTS)
        .map(|c| {
            let base = base.to_string();
            std::thread::spawn(move || {
                let agent = agent();
                let mut rng = ChaCha8Rng::seed_from_u64(c as u64);
                let mut lat = (Vec::new(), Vec::new());
                for _ in 0..requests / CLIENTS {
                    if Instant::now() > deadline {
                        break;
                    }
                    if rng.random_bool(0.5) {
                        let sort = sorts[rng.random_range(0..sorts.len())];
                        let page = rng.random_range(1..=pages * PER_PAGE / 50);
                        let url = format!("{base}/trajectories?sort={sort}&page={page}");
                        lat.0.push(get(&agent, &url).0);
                    } else {
                        let id = rng.random_range(0..trajs);
                        lat.1
                            .push(get(&agent, &format!("{base}/trajectory/{id}")).0);
                    }
                }
                lat
            })
        })
        .collect();
    let (mut lists, mut trajs_lat) = (Vec::new(), Vec::new());
    for h in handles {
        let (l, t) = h.join().expect("client");
        lists.extend(l);
        trajs_lat.extend(t);
    }
    for (name, mut lat) in [
        ("list page (50 rows)", lists),
        ("trajectory page", trajs_lat),
    ] {
        lat.sort();
        if lat.is_empty() {
            continue;
        }
        println!(
            "{CLIENTS} clients, {name}: {} requests, p50 {:.1} ms, p99 {:.1} ms",
            lat.len(),
            percentile(&lat, 0.5),
            percentile(&lat, 0.99)
        );
    }
}
