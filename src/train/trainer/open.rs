use super::{Event, PhasePeaks, PipelineParts, Placement, Prepare, Trainer};
use crate::dist::{GradReducer, ProcessGroup, BUCKET_BYTES};
use crate::models::{DiffusionModel, Family, LoadOptions};
use crate::nn::{Adapters, KeyMap};
use crate::optim::build_groups;
use crate::train::config::{AdapterFormat, ModelDType, TrainConfig};
use crate::train::data::{check_batch_size, Dataset, Samples};
use crate::train::ema::{Ema, EmaSchedule};
use crate::train::images::{self, ImageSamples};
use crate::train::metadata::{count_blocks, identity, DatasetFacts, ModelIdentity, RunMetadata};
use crate::train::planning::{
    phase_plans, plan_memory, state_bytes_per_value, MemoryChoice, PhasePlan,
};
use crate::train::tensorboard::wall_time;
use crate::train::text::TextTraining;
use crate::{models, DType, Device, Error, Result, Tensor};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// The model's identity for adapter metadata, from its family, whether it takes a guidance
/// input, and its checkpoint's tensor names (read from the header only: the block count
/// and SD3.5 medium's second attention tell the variants apart).
fn model_identity(config: &TrainConfig, family: &Family, guidance: bool) -> Result<ModelIdentity> {
    let ckpt = family.open_checkpoint(&config.model.path)?;
    let mut names = vec![];
    for f in &ckpt.files {
        match crate::gguf::is_gguf(f) {
            true => names.extend(crate::gguf::GgufFile::open(f)?.names().map(str::to_string)),
            false => names.extend(
                crate::safetensors::SafeTensorsFile::open(f)?
                    .names()
                    .map(str::to_string),
            ),
        }
    }
    let blocks = count_blocks(
        names.iter().map(String::as_str),
        &["double_blocks.", "joint_blocks.", "transformer_blocks."],
    );
    let attn2 = names.iter().any(|n| n.contains(".attn2."));
    let v = config.model.prediction == crate::train::Prediction::V;
    Ok(identity(family.name, guidance, blocks, attn2, v))
}

/// The adapters made on a model's layers (`map`: its key map) can train and be saved as
/// `config` says: some layer matched, and a PEFT file can name every one.
pub(super) fn check_adapters(
    config: &TrainConfig,
    adapters: &Adapters,
    map: &KeyMap,
) -> Result<()> {
    if adapters.layers()?.is_empty() {
        return Err(Error::Config {
            path: None,
            msg: format!(
                "adapter.targets = {:?} match no Linear layer (nor, with adapter.conv_rank, a \
                 convolution) of the model",
                config.adapter.targets
            ),
        });
    }
    if config.adapter.format == AdapterFormat::Peft {
        adapters.check_peft(map)?;
    }
    // Another trainer's layout: every layer has a module of its names (the config check
    // has refused a family without them).
    if let Some(tool) = config.adapter.format.tool() {
        if let Some(names) = models::family(&config.model.arch)?.tool_names.of(tool) {
            adapters.check_peft(&names.map(map))?;
        }
    }
    Ok(())
}

/// One sum of a reducer bucket's size and one of a single value over `group`, finished: the
/// group's transport is connected and its buffers allocated before memory is measured.
pub(super) fn warm_collectives(group: &dyn ProcessGroup, device: &Device) -> Result<()> {
    if !group.asynchronous() {
        return Ok(());
    }
    // What caching left in FLAME's cache goes back to the driver first: NCCL allocates
    // with the driver, not through FLAME.
    #[cfg(feature = "cuda")]
    #[allow(irrefutable_let_patterns)]
    if let Device::Cuda(c) = device {
        c.release_cached()?;
    }
    for n in [BUCKET_BYTES / 4, 1] {
        let t = Tensor::zeros(n, DType::F32, device)?;
        group.all_reduce_sum(&[&t])?.wait()?;
        t.to_vec_f64()?;
    }
    Ok(())
}

impl Trainer {
    /// Checks the config, loads the model with its adapters and the data, and checks every
    /// sample; fills the image caches; writes nothing else. [`Trainer::open`] with [`Prepare::Encode`] and no notes.
    pub fn new(config: TrainConfig) -> Result<Trainer> {
        Self::open(config, Prepare::Encode, &mut |_| {})
    }

    /// As [`Trainer::new`], telling `on` about data preparation (skipped files, cache
    /// progress); with [`Prepare::DryRun`] the image caches are not filled (the trainer can
    /// then plan but not step).
    pub fn open(
        config: TrainConfig,
        prepare: Prepare,
        on: &mut dyn FnMut(Event),
    ) -> Result<Trainer> {
        Self::open_in(config, prepare, Placement::default(), on)
    }

    /// As [`Trainer::open`], on `place`'s device, as one rank of data-parallel training
    /// when it has a group:
    /// `train.batch_size` is then each rank's part of a global batch of `batch_size` ×
    /// ranks; every rank encodes its share of the image and caption caches (then reads the
    /// whole of them), and only rank 0 writes the run's files.
    /// Errors name the config's keys ([`TrainConfig::named`]).
    pub fn open_in(
        config: TrainConfig,
        prepare: Prepare,
        place: Placement,
        on: &mut dyn FnMut(Event),
    ) -> Result<Trainer> {
        Self::setup(config, prepare, place, on).map_err(TrainConfig::named)
    }

    fn setup(
        config: TrainConfig,
        prepare: Prepare,
        place: Placement,
        on: &mut dyn FnMut(Event),
    ) -> Result<Trainer> {
        let Planned {
            config,
            device,
            group,
            interrupt,
            family,
            mut opts,
            peaks,
            data,
            adapters,
            memory,
            phases,
        } = planned(config, prepare, place, on)?;
        opts.memory = memory.plan.clone();
        peaks.clock_in();
        let loaded = family.load(&config.model.path, &opts).map_err(|e| {
            memory.explain(e).in_phase(|| {
                "loading the model under its memory plan (a lower memory.budget_gb streams \
                 more of it; memory.stream_blocks by hand)"
                    .into()
            })
        })?;
        peaks.clock_out("loading the model");
        super::step::check_loss_options(&config, &loaded.model.objective())?;
        check_adapters(&config, &adapters, &loaded.key_map)?;
        for line in crate::train::groups::block_report(&config, &adapters)? {
            on(Event::Note(line));
        }
        let text = data.text.clone();
        let mut groups = crate::train::groups::param_groups(&config, &adapters)?;
        let lists = super::param_lists(&adapters, text.as_deref())?;
        let all: Vec<(String, Tensor)> = lists.iter().flat_map(|(_, v)| v.clone()).collect();
        // The text encoders' adapters: a group of their own at optimizer.text_encoder_lr, or
        // the default group's parameters where they train at lr.
        let text_params: Vec<(String, Tensor)> = lists
            .into_iter()
            .filter(|(name, _)| *name == "text_encoders")
            .flat_map(|(_, v)| v)
            .collect();
        if !text_params.is_empty() {
            let base = config.optimizer.lr();
            let te_lr = config.optimizer.text_encoder_lr.unwrap_or(base);
            match groups.iter_mut().find(|g| g.name == "default") {
                Some(g) if te_lr == base => g.params.extend(text_params),
                _ => groups.push(crate::optim::ParamGroup {
                    name: "text_encoders".into(),
                    lr_scale: te_lr / base,
                    weight_decay: None,
                    params: text_params,
                }),
            }
        }
        let opt = build_groups(config.optimizer.optimizer_config(), groups).map_err(|e| {
            Error::Config {
                path: None,
                msg: format!("[optimizer]: {e}"),
            }
        })?;
        let scaler = config.loss_scaler();
        let dist = match group {
            Some(g) => {
                let params = all.iter().map(|(_, t)| t.clone()).collect();
                let r = GradReducer::new(g.clone(), params, BUCKET_BYTES);
                Some((g, r))
            }
            None => None,
        };
        let ema = match config.ema.enabled {
            true => Some(Ema::new(
                &all,
                EmaSchedule::of(&config.ema),
                config.ema.device,
            )?),
            false => None,
        };
        let identity = model_identity(&config, family, loaded.model.guidance_input())?;
        let (vae_shape, guided) = (data.vae_shape, data.guided);
        let meta = RunMetadata::new(&config, &identity, &data.facts, wall_time());
        Ok(Trainer {
            ema,
            meta,
            events: Default::default(),
            config,
            memory,
            model: loaded.model,
            map: loaded.key_map,
            adapters,
            text,
            data: data.train,
            validation: data.validation,
            pipeline: data.pipeline,
            opt,
            device,
            dtype: opts.dtype,
            step: 0,
            skipped_in_row: 0,
            scaler,
            run_id: String::new(),
            interrupt,
            dist,
            stop_all: false,
            ahead: None,
            peaks,
            phases,
            family,
            load: opts,
            vae_shape,
            guided,
            released: false,
        })
    }
}

/// What a run works out before any weight of its model is read: the config with its model's
/// pieces found, the device, the data (its caches filled unless a dry run), the adapters,
/// the memory plan and each phase's plan.
struct Planned {
    config: TrainConfig,
    device: Device,
    group: Option<Arc<dyn ProcessGroup>>,
    interrupt: Arc<AtomicBool>,
    family: &'static Family,
    opts: LoadOptions,
    peaks: PhasePeaks,
    data: Data,
    adapters: Arc<Adapters>,
    memory: MemoryChoice,
    phases: Vec<PhasePlan>,
}

fn planned(
    config: TrainConfig,
    prepare: Prepare,
    place: Placement,
    on: &mut dyn FnMut(Event),
) -> Result<Planned> {
    config.validate()?;
    config.check_paths()?;
    let (config, found) = config.discovered()?;
    for line in found {
        on(Event::Note(line));
    }
    #[cfg(feature = "cuda")]
    if config.train.deterministic {
        crate::cuda::set_deterministic(true);
    }
    let device = match place.device {
        Some(d) => d,
        None => Device::chosen(config.train.device)?,
    };
    let group = place.group;
    let interrupt = place.interrupt.unwrap_or_default();
    let world = group.as_ref().map_or(1, |g| g.world());
    let family = models::family(&config.model.arch)?;
    let mut opts = load_options(&config, &device)?;
    let mut peaks = PhasePeaks::default();
    peaks.watch(&device);
    let probe = probe(&config, family, &opts, &device)?;
    // NCCL sets up its connections and buffers at the first collective: one of a
    // bucket's size, now, puts them in the memory measured outside FLAME's allocator. Then
    // the budget is split (once a device) and the allocator capped at its share before any
    // work holds memory: caching is held to the budget as the steps are.
    if let Some(g) = &group {
        warm_collectives(g.as_ref(), &device)?;
    }
    let split = crate::memory::hold_to_budget(&device, config.memory.budget_gb)?;
    // Without a budget, caching and samples plan within what the process could hold at
    // start: a resumed run within no more than it planned in before, every rank within the
    // least of the ranks' shares, so that they choose alike (the encode tile keys the
    // latent cache).
    if let Some(share) = place.share_at_start {
        crate::memory::limit_share_at_start(&device, share)?;
    }
    if let Some(g) = &group {
        crate::memory::agree_memory_at_start(&device, g.as_ref())?;
    }
    let data = Data::prepare(
        &config,
        family,
        probe.as_ref(),
        prepare,
        &device,
        group.as_deref(),
        &interrupt,
        &peaks,
        on,
    )?;
    drop(probe);
    let adapters = config.adapters()?;
    opts.adapters = Some(adapters.clone());
    let largest = data.train.largest();
    // 8-bit products where they pay at the largest bucket's rows (`nn::products_pay`): the
    // plan sizes, and the model loads, that choice.
    opts.run = Some(crate::models::RunShape {
        sample: largest.clone(),
        batch: config.train.batch_size,
        optimizer_bytes_per_value: state_bytes_per_value(&config, world),
    });
    // The trained text encoders' weights, adapters, optimizer state and activations are
    // device memory in every step: the plan counts them.
    let text = match &data.text {
        Some(t) => Some(t.step_bytes(
            config.train.batch_size,
            state_bytes_per_value(&config, world),
            images::encoder_dtype(&config, &device),
        )?),
        None => None,
    };
    let memory = plan_memory(
        &config,
        family,
        &opts,
        &device,
        &largest,
        world,
        split,
        place.machine,
        text.as_ref(),
    )?;
    let phases = phase_plans(
        &config,
        family,
        &opts,
        &memory,
        &largest,
        data.vae_shape,
        data.guided,
        &device,
        world,
    )?;
    note_phases_past_the_budget(&memory, &phases, on);
    Ok(Planned {
        config,
        device,
        group,
        interrupt,
        family,
        opts,
        peaks,
        data,
        adapters,
        memory,
        phases,
    })
}

/// What a run of `config` would do with memory, worked out as `train --plan` does (the
/// data scanned and every picture decoded, the encoders run on the empty caption for the
/// shapes, the same planner) but without reading the model's weights: the memory plan, each
/// phase's plan and the training data in words. Writes nothing. Errors name the config's
/// keys.
pub fn plan_run(
    config: TrainConfig,
    place: Placement,
    on: &mut dyn FnMut(Event),
) -> Result<(MemoryChoice, Vec<PhasePlan>, String)> {
    let p = planned(config, Prepare::DryRun, place, on).map_err(TrainConfig::named)?;
    Ok((p.memory, p.phases, p.data.train.describe()))
}

/// The load options of `config`'s model on `device`, without adapters, under the default
/// memory plan: the dtype, FP8, and the diffusers config.json given for a single file.
fn load_options(config: &TrainConfig, device: &Device) -> Result<LoadOptions> {
    let m = &config.model;
    let json = match &m.config {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| Error::Io {
                path: p.clone(),
                source,
            })?;
            Some(serde_json::from_str(&text).map_err(|e| Error::Config {
                path: Some(p.clone()),
                msg: format!("model.config: invalid JSON: {e}"),
            })?)
        }
        None => None,
    };
    if let Some(code) = m.compute.code() {
        check_products(config, code, device)?;
    }
    Ok(LoadOptions {
        dtype: m.dtype.compute_dtype(),
        device: device.clone(),
        adapters: None,
        config: json,
        fp8: m.dtype == ModelDType::Fp8,
        int8_rotation: m.int8_rotation,
        products: m.compute.code(),
        memory: crate::memory::Plan::default(),
        merge: None,
        run: None,
    })
}

/// `model.compute = "fp8"` or "int8" where the base and the device can run those products
/// (`models::products_refusal`).
fn check_products(
    config: &TrainConfig,
    code: crate::backend::fp8::Code8,
    device: &Device,
) -> Result<()> {
    match crate::models::products_refusal(code, &config.model.path, device) {
        Some(why) => Err(Error::Config {
            path: None,
            msg: format!(
                "model.compute = \"{}\" {why}; use compute = \"bf16\"",
                code.name()
            ),
        }),
        None => Ok(()),
    }
}

/// The model's inputs and shape checks, and the adapters on its layers, from one build
/// without weights (on the CPU where the build has it; the adapters a set of their own,
/// dropped with the build): bad data, targets that match nothing, a rank a layer cannot
/// take, a PEFT layout the model cannot be given and an impossible memory budget fail before
/// any data is cached or weight read.
fn probe(
    config: &TrainConfig,
    family: &Family,
    opts: &LoadOptions,
    device: &Device,
) -> Result<Box<dyn DiffusionModel>> {
    let trial = config.adapters()?;
    let built = family.probe(
        &config.model.path,
        &LoadOptions {
            adapters: Some(trial.clone()),
            device: Device::cpu_backend().unwrap_or_else(|_| device.clone()),
            ..opts.clone()
        },
    )?;
    check_adapters(config, &trial, &built.key_map)?;
    // The builder and key map (holding the trial adapters) go here, the model stays.
    Ok(built.model)
}

/// The run's data, checked against the model: pre-encoded samples, or images with their
/// caches filled (unless a dry run) and what sampling needs of the pipeline.
struct Data {
    train: Box<dyn Samples>,
    /// The trained text encoders (`adapter.text_encoders`), if any.
    text: Option<Arc<TextTraining>>,
    validation: Option<ImageSamples>,
    pipeline: Option<PipelineParts>,
    /// The autoencoder's downscale factor and its image width, for the phases' plans.
    vae_shape: Option<(usize, usize)>,
    /// Whether the model takes a guidance input.
    guided: bool,
    /// The training data as adapter metadata counts it.
    facts: DatasetFacts,
}

impl Data {
    #[allow(clippy::too_many_arguments)]
    fn prepare(
        config: &TrainConfig,
        family: &'static Family,
        probe: &dyn DiffusionModel,
        prepare: Prepare,
        device: &Device,
        group: Option<&dyn ProcessGroup>,
        interrupt: &Arc<AtomicBool>,
        peaks: &PhasePeaks,
        on: &mut dyn FnMut(Event),
    ) -> Result<Data> {
        let world = group.map_or(1, |g| g.world());
        let guided = probe.guidance_input();
        let inputs = probe.inputs();
        if let Some(dir) = &config.data.dir {
            if !config.adapter.text_encoders.is_empty() {
                return Err(Error::Config {
                    path: None,
                    msg: "adapter.text_encoders: pre-encoded samples (data.dir) hold no \
                          captions to encode; train the text encoders from images"
                        .into(),
                });
            }
            let data = Dataset::open(dir, &inputs, &|s| probe.check_shapes(s))?;
            check_batch_size(config, world, data.len(), "pre-encoded samples")?;
            return Ok(Data {
                facts: DatasetFacts::encoded(dir, data.len()),
                train: Box::new(data),
                text: None,
                validation: None,
                pipeline: None,
                vae_shape: None,
                guided,
            });
        }
        peaks.start(device, "caching");
        let run = images::prepare(
            config,
            family,
            &inputs,
            guided,
            &|s| probe.check_shapes(s),
            device,
            prepare == Prepare::Encode,
            world,
            group,
            interrupt,
            &mut |n| on(Event::Note(n)),
        )?;
        peaks.end(device, "caching");
        probe
            .check_shapes(&run.train.largest())
            .map_err(|msg| Error::Config {
                path: None,
                msg: format!("[data]: {msg}"),
            })?;
        let text = match config.adapter.text_encoders.is_empty() {
            true => None,
            false => {
                let (text_at, _) = images::locate(config, family)?;
                let budget = images::driver_budget(config, device)?;
                let opts = images::training_text_options(config, family, &text_at, guided, budget);
                let dtype = images::encoder_dtype(config, device);
                let t = TextTraining::open(config, family, &text_at, &opts, dtype, device)?;
                if let Some(t) = &t {
                    on(Event::Note(t.summary.clone()));
                }
                t
            }
        };
        let mut train = run.train;
        train.set_live(text.clone());
        let mut validation = run.validation;
        if let Some(v) = &mut validation {
            v.set_live(text.clone());
        }
        Ok(Data {
            text,
            facts: DatasetFacts::of_items(&train.ds.items),
            vae_shape: Some((run.vae_factor, run.vae_width)),
            pipeline: Some(PipelineParts {
                text: run.text,
                vae: run.vae,
                factor: run.vae_factor,
                references: run.sample_references,
                pictures: run.pictures,
            }),
            train: Box::new(train),
            validation,
            guided,
        })
    }
}

/// Tells `on` of each phase whose predicted peak passes the budget, with the knob that
/// lowers it.
fn note_phases_past_the_budget(
    memory: &MemoryChoice,
    phases: &[PhasePlan],
    on: &mut dyn FnMut(Event),
) {
    let Some(cap) = memory.budget else {
        return;
    };
    const GIB: f64 = (1u64 << 30) as f64;
    for p in phases.iter().filter(|p| p.peak.is_some_and(|b| b > cap)) {
        on(Event::Note(format!(
            "{} may not fit memory.budget_gb: predicted up to {:.2} GiB of the {:.2} GiB \
             FLAME's allocator may hold ({}); {}",
            p.phase,
            p.peak.unwrap_or(0) as f64 / GIB,
            cap as f64 / GIB,
            p.plan,
            match p.phase {
                "sample images" => "a smaller sample.size or encoders.vae_tile lowers it",
                "caching" => {
                    "encoders.vae_tile = 512 and encoders.stream_t5 (or stream_qwen3) = \"on\" \
                     lower it"
                }
                _ => "a larger budget or a smaller batch lowers it",
            }
        )));
    }
}
