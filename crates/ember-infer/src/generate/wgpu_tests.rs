//! Decoding's tests on wgpu, and the sharp random models they (and the replayed path's tests)
//! decode with.

use burn::module::{Module, Param};
use burn::tensor::DeviceKind;
use burn::tensor::Distribution;
use ember_model::{DecoderOnlyConfig, PositionalKind};

use super::*;
use burn::tensor::{Device, Tensor};

/// A random model on wgpu with every matrix scaled up (unit-scale embeddings, sharp
/// attention, an untied head), so its logits are far apart and its greedy text depends on
/// position and context (at init scale it repeats one token).
pub(crate) fn model(positional: PositionalKind) -> DecoderOnly {
    model_with_context(positional, 16)
}

/// [`model`] with room for `context_len` positions.
pub(crate) fn model_with_context(positional: PositionalKind, context_len: usize) -> DecoderOnly {
    // The tests run in parallel on one device, whose random numbers are one stream: the
    // seeding and the draws under a lock, or another test's draws land between them and the
    // weights change from run to run (once, a model that repeated one token).
    static DRAWS: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _draws = DRAWS.lock().unwrap_or_else(|e| e.into_inner());
    let device = Device::wgpu(DeviceKind::DefaultDevice);
    // Seeded: the same weights in every run.
    device.seed(11);
    let config = DecoderOnlyConfig {
        vocab_size: 23,
        d_model: 32,
        n_heads: 4,
        n_layers: 2,
        context_len,
        positional,
        tie_weights: false,
        ..Default::default()
    };
    config.init(&device).unwrap().map(&mut UnitMatrices)
}

struct UnitMatrices;

impl burn::module::ModuleMapper for UnitMatrices {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
        let device = param.val().device();
        let dims = param.val().dims();
        match D {
            2 => Param::from_tensor(Tensor::random(
                dims,
                Distribution::Normal(0.0, 1.0),
                &device,
            )),
            _ => param,
        }
    }
}

pub(crate) fn greedy(use_cache: bool, max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling: Sampling {
            greedy: true,
            ..Default::default()
        },
        seed: 1,
        use_cache,
        context_len: 16,
    }
}

fn greedy_choice() -> (Choice, StdRng) {
    (Choice::Greedy, StdRng::seed_from_u64(1))
}

#[test]
fn greedy_chosen_on_the_device_equals_the_host_paths() {
    for positional in [PositionalKind::Learned, PositionalKind::Rotary] {
        let m = model(positional);
        let prompt = [1, 2, 3];
        // 45 new tokens in a context of 16: the cache is rebuilt on the way, and the ids
        // are read in bursts of 16 and a last shorter one.
        let cached = greedy(true, 45);
        let host = generate_on_host(&m, &prompt, &cached, 16, |_| true);
        let seen = std::cell::RefCell::new(Vec::new());
        let device = decode_on_device(&m, &prompt, 45, 16, greedy_choice(), |id| {
            seen.borrow_mut().push(id);
            true
        });
        assert_eq!(device, host, "{positional:?}");
        assert_eq!(
            seen.into_inner(),
            host,
            "{positional:?}: on_token saw every id"
        );
        let distinct: std::collections::HashSet<_> = host.iter().collect();
        assert!(distinct.len() > 4, "too uniform to compare: {host:?}");
        // Through `generate`, which takes the device path here.
        assert_eq!(generate(&m, &prompt, &cached, |_| true), host);
        // While everything fits in the context, the no-cache path (the whole window each
        // step) agrees too.
        let fits = generate_on_host(&m, &prompt, &greedy(false, 13), 16, |_| true);
        assert_eq!(fits[..], host[..13], "{positional:?}");
    }
}

#[test]
fn a_stop_inside_a_burst_ends_the_device_path_where_it_ends_the_host_path() {
    let m = model(PositionalKind::Learned);
    // Asks to stop at the 20th id, the 4th of the second burst.
    let stop_at_20 = || {
        let mut count = 0;
        move |_| {
            count += 1;
            count < 20
        }
    };
    let device = decode_on_device(&m, &[4], 45, 16, greedy_choice(), stop_at_20());
    let host = generate_on_host(&m, &[4], &greedy(true, 45), 16, stop_at_20());
    assert_eq!(device.len(), 20);
    assert_eq!(device, host);
}

#[test]
fn temperature_draws_on_the_device_equal_the_host_draws_of_the_same_seed() {
    let m = model(PositionalKind::Rotary);
    for (temperature, seed) in [(1.0, 3), (3.0, 4)] {
        let options = GenerateOptions {
            sampling: Sampling {
                temperature,
                ..Default::default()
            },
            seed,
            ..greedy(true, 45)
        };
        assert_eq!(
            Choice::on_device(&options.sampling),
            Some(Choice::Temperature(temperature))
        );
        let host = generate_on_host(&m, &[1, 2], &options, 16, |_| true);
        let rng = StdRng::seed_from_u64(seed);
        let device = decode_on_device(
            &m,
            &[1, 2],
            45,
            16,
            (Choice::Temperature(temperature), rng),
            |_| true,
        );
        assert_eq!(device, host, "temperature {temperature}");
        assert_eq!(generate(&m, &[1, 2], &options, |_| true), host);
        // The draws are not the argmax's choices.
        let argmax = generate_on_host(&m, &[1, 2], &greedy(true, 45), 16, |_| true);
        assert_ne!(host, argmax, "temperature {temperature}");
    }
    // Top-k, top-p and the repetition penalty stay on the host.
    for sampling in [
        Sampling {
            top_k: Some(5),
            ..Default::default()
        },
        Sampling {
            top_p: Some(0.9),
            ..Default::default()
        },
        Sampling {
            repetition_penalty: 1.2,
            greedy: true,
            ..Default::default()
        },
    ] {
        assert_eq!(Choice::on_device(&sampling), None, "{sampling:?}");
    }
}
