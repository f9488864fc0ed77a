//! An estimate's table of bytes and its verdict.

use autotune::estimate::{Attention, Estimate, Phase};
use autotune::spec::budget::Budget;
use autotune::spec::device::DeviceSpec;
use autotune::{Knobs, ModelSpec};

use super::bytes;

pub fn table(
    model: &ModelSpec,
    target: &DeviceSpec,
    knobs: &Knobs,
    attention: Attention,
    est: &Estimate,
) -> String {
    let attention = match attention {
        Attention::Flash => "flash attention",
        Attention::Materialized => "attention probabilities kept",
    };
    let mut text = format!(
        "{} ({:.1}M parameters) at {knobs} on {}, {attention}\n\n{:<16} {:>12} {:>12}\n",
        model.name,
        model.parameter_count() as f64 / 1e6,
        target.name,
        "",
        "GPU",
        "host"
    );
    let gpu = est.gpu.map(|g| g.parts());
    for (i, (name, host)) in est.host.parts().into_iter().enumerate() {
        let on_gpu = gpu.map_or("-".to_string(), |g| bytes(g[i].1));
        text.push_str(&format!("{name:<16} {on_gpu:>12} {:>12}\n", bytes(host)));
    }
    let total = est.gpu.map_or("-".to_string(), |g| bytes(g.total()));
    text.push_str(&format!(
        "{:<16} {total:>12} {:>12}",
        "total",
        bytes(est.host.total())
    ));
    text
}

pub fn verdict(est: &Estimate, budget: &Budget, fits: bool, largest: Option<usize>) -> String {
    let phase = match est.peak_phase {
        Phase::Head => "the head's loss and gradient, after the forward pass",
        Phase::BackwardStart => "the start of the backward pass",
        Phase::BackwardEnd => "the end of the backward pass",
        Phase::AfterBackward => "after the backward pass, every gradient held",
    };
    let usable = match budget.usable_gpu_bytes() {
        Some(g) => format!(
            "GPU {}, host {}",
            bytes(g),
            bytes(budget.usable_host_bytes())
        ),
        None => format!("host {}", bytes(budget.usable_host_bytes())),
    };
    let answer = if fits { "fits" } else { "does not fit" };
    let largest = largest.map_or("no micro-batch fits".to_string(), |b| {
        format!("the largest micro-batch that fits is {b}")
    });
    format!(
        "\npeak at {phase}\n{answer} the usable {usable} (headroom {:.0}%); {largest}",
        budget.headroom * 100.0
    )
}
