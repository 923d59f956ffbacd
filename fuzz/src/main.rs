//! `make fuzz`: runs the seeded parser fuzzer (`imfault_fuzz::run`) and reports.
//! `imfault-fuzz [--seed N] [--inputs N]`; exit 1 (and the input saved under
//! `fuzz/corpus/failures/`) on the first violated property, 2 on a usage error.

use std::time::Instant;

fn main() {
    let mut seed: u64 = 1;
    let mut inputs: u64 = 10_000_000;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> u64 {
            match args.next().and_then(|v| v.replace('_', "").parse().ok()) {
                Some(v) => v,
                None => {
                    eprintln!("imfault-fuzz: {name} needs a whole number");
                    std::process::exit(2);
                }
            }
        };
        match a.as_str() {
            "--seed" => seed = num("--seed"),
            "--inputs" => inputs = num("--inputs"),
            "-h" | "--help" => {
                println!("usage: imfault-fuzz [--seed N (1)] [--inputs N (10000000)]");
                return;
            }
            other => {
                eprintln!("imfault-fuzz: unknown argument {other:?} (try --help)");
                std::process::exit(2);
            }
        }
    }
    let started = Instant::now();
    // Progress every 10%, in chunks that each restart from a derived seed.
    let chunks = 10u64;
    let per = inputs.div_ceil(chunks);
    let mut total = imfault_fuzz::Stats::default();
    for c in 0..chunks {
        let n = per.min(inputs - (c * per).min(inputs));
        if n == 0 {
            break;
        }
        let (stats, failure) = imfault_fuzz::run(seed.wrapping_add(c), n);
        total.inputs += stats.inputs;
        total.slowest = total.slowest.max(stats.slowest);
        for (k, v) in stats.accepted {
            *total.accepted.entry(k).or_default() += v;
        }
        for (k, v) in stats.refused {
            *total.refused.entry(k).or_default() += v;
        }
        if let Some(f) = failure {
            let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/corpus/failures");
            let _ = std::fs::create_dir_all(dir);
            let path = format!("{dir}/seed{}-input{}.bin", seed.wrapping_add(c), f.index);
            let _ = std::fs::write(&path, &f.input);
            eprintln!(
                "imfault-fuzz: FAIL after {} inputs: {}\n  input saved to {path}\n  repeat: imfault-fuzz --seed {} --inputs {}",
                total.inputs,
                f.what,
                seed.wrapping_add(c),
                f.index + 1
            );
            std::process::exit(1);
        }
        eprintln!(
            "imfault-fuzz: {} inputs, no panic, no violation ({:.1} s)",
            total.inputs,
            started.elapsed().as_secs_f64()
        );
    }
    println!(
        "imfault-fuzz: PASS: {} inputs (seed {seed}) in {:.1} s; accepted {:?}; refused {:?}; slowest parse {:?}",
        total.inputs,
        started.elapsed().as_secs_f64(),
        total.accepted,
        total.refused,
        total.slowest
    );
}
