//! `#[derive(SagaEvent)]`: an event payload and the event type (`ce_type`) it travels under, or a family of
//! events, one type per variant. Re-exported by `saga-core` and `saga-consumer`; see `saga_core::SagaEvent`.
//!
//! - On a struct: one event type, the struct's name unless `#[saga(event_type = "...")]` says otherwise.
//!   The payload is the struct as JSON (it derives `Serialize` and `Deserialize`).
//! - On an enum whose variants each hold one payload (`PaymentFailed(Setback)`): one event type per
//!   variant, its name unless `#[saga(event_type = "...")]` on it says otherwise, and an associated
//!   constant with it (`OrderSetback::PAYMENT_FAILED`). The payload is the variant's value as JSON; the
//!   event type says which variant it is.
//!
//! The generated code names the crate `saga_consumer` (a service's one dependency); `#[saga(crate =
//! "saga_core")]` names another path.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as Tokens;
use quote::quote;
use syn::{Data, DeriveInput, Fields, LitStr, Path, parse_macro_input};

/// Derives `SagaEvent` (see the crate documentation).
#[proc_macro_derive(SagaEvent, attributes(saga))]
pub fn derive_saga_event(input: TokenStream) -> TokenStream {
    let input = parse_macro_input!(input as DeriveInput);
    expand(&input)
        .unwrap_or_else(syn::Error::into_compile_error)
        .into()
}

/// What `#[saga(...)]` says on an item or a variant.
#[derive(Default)]
struct Options {
    event_type: Option<LitStr>,
    krate: Option<Path>,
}

fn options(attrs: &[syn::Attribute]) -> syn::Result<Options> {
    let mut options = Options::default();
    for attr in attrs.iter().filter(|a| a.path().is_ident("saga")) {
        attr.parse_nested_meta(|meta| {
            if meta.path.is_ident("event_type") {
                options.event_type = Some(meta.value()?.parse()?);
                Ok(())
            } else if meta.path.is_ident("crate") {
                let path: LitStr = meta.value()?.parse()?;
                options.krate = Some(path.parse()?);
                Ok(())
            } else {
                Err(meta.error("expected `event_type = \"...\"` or `crate = \"...\"`"))
            }
        })?;
    }
    Ok(options)
}

fn expand(input: &DeriveInput) -> syn::Result<Tokens> {
    let item = options(&input.attrs)?;
    let krate = item
        .krate
        .clone()
        .unwrap_or_else(|| syn::parse_quote!(::saga_consumer));
    let name = &input.ident;
    let (impl_generics, type_generics, where_clause) = input.generics.split_for_impl();
    match &input.data {
        Data::Struct(_) => {
            let event_type = item
                .event_type
                .unwrap_or_else(|| LitStr::new(&name.to_string(), name.span()));
            Ok(quote! {
                impl #impl_generics #krate::SagaEvent for #name #type_generics #where_clause {
                    const TYPES: &'static [&'static str] = &[#event_type];
                    fn event_type(&self) -> &'static str {
                        #event_type
                    }
                    fn to_json(&self) -> ::core::result::Result<::std::vec::Vec<u8>, #krate::__private::serde_json::Error> {
                        #krate::__private::serde_json::to_vec(self)
                    }
                }
            })
        }
        Data::Enum(data) => {
            if item.event_type.is_some() {
                return Err(syn::Error::new_spanned(
                    name,
                    "an enum's event types are its variants': put `#[saga(event_type = \"...\")]` on a variant",
                ));
            }
            let mut types = Vec::new();
            let mut variants = Vec::new();
            for variant in &data.variants {
                let Fields::Unnamed(fields) = &variant.fields else {
                    return Err(syn::Error::new_spanned(
                        variant,
                        "each variant of an event family holds one payload: `PaymentFailed(Setback)`",
                    ));
                };
                if fields.unnamed.len() != 1 {
                    return Err(syn::Error::new_spanned(
                        variant,
                        "each variant of an event family holds exactly one payload",
                    ));
                }
                let ident = &variant.ident;
                let event_type = options(&variant.attrs)?
                    .event_type
                    .unwrap_or_else(|| LitStr::new(&ident.to_string(), ident.span()));
                types.push(event_type.clone());
                variants.push((ident, event_type));
            }
            if variants.is_empty() {
                return Err(syn::Error::new_spanned(
                    name,
                    "an event family needs at least one variant",
                ));
            }
            let consts = variants.iter().map(|(ident, ty)| {
                let name = syn::Ident::new(&screaming_snake(&ident.to_string()), ident.span());
                let doc = format!("The event type of [`{}::{}`].", input.ident, ident);
                quote! {
                    #[doc = #doc]
                    pub const #name: &'static str = #ty;
                }
            });
            let type_arms = variants
                .iter()
                .map(|(ident, ty)| quote!(Self::#ident(_) => #ty));
            let json_arms = variants.iter().map(
                |(ident, _)| quote!(Self::#ident(payload) => #krate::__private::serde_json::to_vec(payload)),
            );
            let decode_arms = variants.iter().map(
                |(ident, ty)| quote!(#ty => ::core::result::Result::Ok(Self::#ident(#krate::__private::serde_json::from_slice(json)?))),
            );
            Ok(quote! {
                impl #impl_generics #name #type_generics #where_clause {
                    #(#consts)*
                }
                impl #impl_generics #krate::SagaEvent for #name #type_generics #where_clause {
                    const TYPES: &'static [&'static str] = &[#(#types),*];
                    fn event_type(&self) -> &'static str {
                        match self { #(#type_arms,)* }
                    }
                    fn to_json(&self) -> ::core::result::Result<::std::vec::Vec<u8>, #krate::__private::serde_json::Error> {
                        match self { #(#json_arms,)* }
                    }
                }
                impl #impl_generics #krate::FromEvent for #name #type_generics #where_clause {
                    fn from_event(event_type: &str, json: &[u8]) -> ::core::result::Result<Self, #krate::__private::serde_json::Error> {
                        match event_type {
                            #(#decode_arms,)*
                            other => ::core::result::Result::Err(
                                <#krate::__private::serde_json::Error as #krate::__private::serde::de::Error>::custom(
                                    ::std::format!("{} has no variant for event type {:?}", ::core::stringify!(#name), other),
                                ),
                            ),
                        }
                    }
                }
            })
        }
        Data::Union(_) => Err(syn::Error::new_spanned(
            name,
            "SagaEvent derives for a struct or an enum",
        )),
    }
}

/// `PaymentFailed` as `PAYMENT_FAILED`.
fn screaming_snake(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.extend(c.to_uppercase());
    }
    out
}
